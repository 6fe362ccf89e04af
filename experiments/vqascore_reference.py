"""Pin VQAScore reference values from the authors' own code (t2v_metrics) for tests/test_vqascore.py.

Runs the authors' ``Qwen2VLModel.forward`` (t2v_metrics/models/vqascore_models/qwen2vl_model.py) on the tiny
Qwen2.5-VL of tests/tiny_vlms.build_vqascore_qwen, and the authors' API rule (``GPT4VModel.forward_single`` of
gpt4v_model.py) on recorded top-logprob answers given through a stand-in client. The side environment: this
project's venv plus qwen-vl-utils (``pip install --no-deps --target DIR qwen-vl-utils``, it needs no more for
images) and a t2v_metrics checkout; the modules those files import for video or OpenAI only (decord, cv2,
tiktoken, torchvision inside qwen-vl-utils) are stubbed, since images and a stand-in client never reach them.

    python -m experiments.vqascore_reference --t2v-metrics /path/to/t2v_metrics --side /path/to/qwen-vl-utils-dir
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import types
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "vqascore_reference.json"
CAPTIONS = ["a red cube", "two blue circles", "a cat on the left of a dog", "Yes"]
# recorded first-token top logprobs (as a server returns them) covering the rule's branches
RECORDED_TOPS = [
    [["Yes", -0.105], ["No", -2.3]],
    [["No", -0.05], ["Yes", -3.0]],
    [["No", -0.2], ["The", -1.8]],
    [["The", -0.4], ["A", -1.2]],
    [["Yes", -0.3], [" yes", -2.5], ["YES", -4.0]],
    [[" No", -0.01], ["no", -4.6]],
]


def _stub(name: str, **attrs) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


def _load_authors(t2v: Path, file: str):
    """Import one vqascore_models file under a stub package (its base class is only an interface)."""
    if "t2v_ref" not in sys.modules:
        package = types.ModuleType("t2v_ref")
        package.__path__ = [str(t2v / "t2v_metrics/models/vqascore_models")]
        sys.modules["t2v_ref"] = package
        _stub("t2v_ref.vqa_model", VQAScoreModel=object)
    spec = importlib.util.spec_from_file_location(f"t2v_ref.{file}", t2v / "t2v_metrics/models/vqascore_models" / f"{file}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def local_reference(t2v: Path, folder: Path) -> list[float]:
    from transformers import Qwen2_5_VLForConditionalGeneration

    sys.path.insert(0, str(ROOT))
    from rewards.vlm import load_processor  # picks the processor class without torchvision; no scoring code

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()
    processor = load_processor(str(folder))
    # only video paths use these; stubbed after transformers has looked for torchvision
    _stub("decord", VideoReader=None, cpu=None)
    transforms = types.SimpleNamespace(InterpolationMode=None)
    _stub("torchvision", io=None, transforms=transforms, __version__="0.0")
    _stub("torchvision.transforms", InterpolationMode=None)
    authors = _load_authors(t2v, "qwen2vl_model")
    scorer = authors.Qwen2VLModel.__new__(authors.Qwen2VLModel)
    scorer.model, scorer.processor, scorer.device, scorer.model_info = model, processor, "cpu", {"fps": 8.0}
    from align.testing.tiny_vlms import vqascore_images

    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, image in enumerate(vqascore_images(len(CAPTIONS))):
            paths.append(f"{tmp}/{i}.png")
            image.save(paths[-1])
        return [float(s) for s in scorer.forward(paths, CAPTIONS)]


def api_reference(t2v: Path) -> list[float]:
    _stub("cv2")
    _stub("tiktoken")
    authors = _load_authors(t2v, "gpt4v_model")
    values = []
    for top in RECORDED_TOPS:
        entries = [SimpleNamespace(token=t, logprob=lp) for t, lp in top]
        completion = SimpleNamespace(choices=[SimpleNamespace(
            message=SimpleNamespace(content=top[0][0]),
            logprobs=SimpleNamespace(content=[SimpleNamespace(token=top[0][0], top_logprobs=entries)]))])
        client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=lambda _c=completion, **_: _c)))
        scorer = authors.GPT4VModel.__new__(authors.GPT4VModel)
        scorer.client, scorer.top_logprobs, scorer.model_name = client, len(top), "gpt-4o"
        data = {"path": "x.png", "type": "png", "base64": ""}
        values.append(float(scorer.forward_single(data, 'Does this figure show "x"? Please answer Yes or No.', "Yes")))
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--t2v-metrics", type=Path, required=True, help="a t2v_metrics checkout (repository root)")
    parser.add_argument("--side", type=Path, required=True, help="folder holding qwen_vl_utils")
    args = parser.parse_args()
    sys.path.insert(0, str(args.side))
    from align.testing.tiny_vlms import build_vqascore_qwen

    with tempfile.TemporaryDirectory() as tmp:
        build_vqascore_qwen(tmp)
        local = local_reference(args.t2v_metrics, Path(tmp))
    record = {"source": "github.com/linzhiqiu/t2v_metrics @ 6ecb74f, qwen2vl_model.py forward and gpt4v_model.py "
                        "forward_single, run by experiments/vqascore_reference.py",
              "captions": CAPTIONS, "local_scores": local,
              "recorded_top_logprobs": RECORDED_TOPS, "api_scores": api_reference(args.t2v_metrics)}
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
