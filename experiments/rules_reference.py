"""Reference values for the OCR and GenEval rules, computed by the authors' own code on recorded inputs.

    python -m experiments.rules_reference --authors DIR [--out tests/data]

DIR holds the authors' files, unchanged:
    evaluate_images.py, object_names.txt, evaluation_metadata.jsonl   djghosh13/geneval @ af4902f
    gen_eval.py                                                         yifan123/reward-server @ 92ac29f
    ocr.py                                                              yifan123/flow_grpo @ ac4c86e
    ocr_prompts.txt (optional)                                          flow_grpo dataset/ocr/test.txt

The models are what cannot run here (mmdetection's Mask2Former and open_clip's CLIP need CUDA and
downloads; PaddleOCR downloads its weights at run time), so their outputs are recorded inputs: stub
modules stand in for mmdet / open_clip / clip_benchmark / paddleocr, return the recorded detections,
colours and OCR lines, and everything after them is the authors' code as written. The detections and
OCR lines are drawn by this script (seeded) to cover every branch of the rules; they are not outputs
of a real detector. The OCR reference needs the ``Levenshtein`` package (python-Levenshtein).

Side environment used for the pinned values: this project's Python (torch 2.13 CPU, transformers 5) plus
``pip install python-Levenshtein==0.27.5 clip_benchmark==1.6.2 scikit-learn`` (clip_benchmark with --no-deps:
its torchvision and webdataset are not imported by the functions used). GenEval's and the reward server's
files need no change; their CUDA assert at import is satisfied by reporting CUDA as available while they load.

Writes geneval_rules_reference.json and ocr_rule_reference.json into --out; ``--only colour`` writes
geneval_colour_reference.json (the authors' colour classification on a tiny CLIP; needs clip_benchmark).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
from PIL import Image

COLORS = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]
SIDE = 512


# ---------------------------------------------------------------- stubs for the models


def _install_stubs(record: dict) -> None:
    """Modules the authors import for their models; each returns what ``record`` holds."""
    mmdet = types.ModuleType("mmdet")
    mmdet.__file__ = "/nonexistent/mmdet/__init__.py"
    apis = types.ModuleType("mmdet.apis")
    apis.init_detector = lambda *a, **k: "detector"
    apis.inference_detector = lambda detector, inputs: record["detections"](inputs)
    mmdet.apis = apis
    open_clip = types.ModuleType("open_clip")
    open_clip.create_model_and_transforms = lambda *a, **k: ("clip", None, lambda image: image)
    open_clip.get_tokenizer = lambda arch: "tokenizer"
    zsc = types.ModuleType("clip_benchmark.metrics.zeroshot_classification")
    metrics = types.ModuleType("clip_benchmark.metrics")
    metrics.zeroshot_classification = zsc
    bench = types.ModuleType("clip_benchmark")
    bench.metrics = metrics
    paddleocr = types.ModuleType("paddleocr")

    class PaddleOCR:
        def __init__(self, **kwargs):
            pass

        def ocr(self, image, cls=False):
            return record["ocr"](image)

    paddleocr.PaddleOCR = PaddleOCR
    sys.modules.update({
        "mmdet": mmdet, "mmdet.apis": apis, "open_clip": open_clip, "clip_benchmark": bench,
        "clip_benchmark.metrics": metrics, "clip_benchmark.metrics.zeroshot_classification": zsc,
        "paddleocr": paddleocr,
    })


def _colour_stub(colours: dict):
    """The authors' color_classification replaced by the recorded colour of each (class, box row)."""
    def color_classification(image, bboxes, classname):
        return [colours[(classname, tuple(float(v) for v in row))] for row, _ in bboxes]

    return color_classification


def load_geneval_module(authors: Path, record: dict, classnames: list[str]) -> dict:
    import torch

    namespace = {"__name__": "geneval_evaluate_images", "__file__": str(authors / "evaluate_images.py")}
    available, torch.cuda.is_available = torch.cuda.is_available, lambda: True  # the module asserts CUDA at import
    try:
        exec(compile((authors / "evaluate_images.py").read_text(), "evaluate_images.py", "exec"), namespace)
    finally:
        torch.cuda.is_available = available
    namespace.update(THRESHOLD=0.3, COUNTING_THRESHOLD=0.9, MAX_OBJECTS=16, NMS_THRESHOLD=1.0, POSITION_THRESHOLD=0.1,
                     classnames=classnames, object_detector="detector")
    return namespace


def load_reward_server(authors: Path, classnames: list[str]) -> dict:
    """The functions nested in gen_eval.load_geneval (they need its closure's names as globals)."""
    tree = ast.parse((authors / "gen_eval.py").read_text())
    outer = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "load_geneval")
    wanted = {"compute_iou", "relative_position", "evaluate", "evaluate_reward", "evaluate_image"}
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    nested = [n for n in outer.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    module = ast.Module(body=imports + nested, type_ignores=[])
    namespace = {"__name__": "reward_server_gen_eval"}
    exec(compile(module, "gen_eval.py", "exec"), namespace)
    namespace.update(THRESHOLD=0.3, COUNTING_THRESHOLD=0.9, MAX_OBJECTS=16, NMS_THRESHOLD=1.0, POSITION_THRESHOLD=0.1,
                     COLORS=COLORS, object_detector="detector", classnames=classnames)
    return namespace


# ---------------------------------------------------------------- GenEval cases


def _random_box(rng: random.Random) -> list[float]:
    w, h = rng.uniform(20, 260), rng.uniform(20, 260)
    x0, y0 = rng.uniform(0, SIDE - w), rng.uniform(0, SIDE - h)
    return [round(x0, 2), round(y0, 2), round(x0 + w, 2), round(y0 + h, 2)]


def _random_detections(rng: random.Random, metadata: dict, classnames: list[str]) -> dict:
    classes = [r["class"] for r in metadata["include"]] + [rng.choice(classnames)]
    wanted = {r["class"]: r.get("color") for r in metadata["include"]}
    scores = iter(rng.sample(range(1, 1000), 60))  # distinct confidences: the authors' argsort order is then defined
    out = {}
    for classname in dict.fromkeys(classes):
        items = []
        for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 4])):
            score = rng.choice([next(scores) / 1000, rng.choice([0.3, 0.9, 0.301, 0.899, 0.95, 0.2])])
            if metadata["tag"] == "counting" and rng.random() < 0.7:  # counting keeps only confidences above 0.9
                score = 0.9 + next(scores) / 10000
            colour = wanted.get(classname) if wanted.get(classname) and rng.random() < 0.6 else rng.choice(COLORS)
            items.append({"box": _random_box(rng), "score": score, "colour": colour})
        # a confidence drawn twice makes the authors' order depend on numpy's sort: keep them distinct
        seen, unique = set(), []
        for item in items:
            if item["score"] not in seen:
                seen.add(item["score"])
                unique.append(item)
        out[classname] = unique
    return out


def _position_cases() -> list[dict]:
    """Two boxes at offsets around the margin: the relation sets where the rule is most delicate."""
    cases = []
    for dx in (-120, -60, -25, -19, 0, 19, 25, 60, 120):
        for dy in (-80, -21, 0, 21, 80):
            a = [200 + dx, 200 + dy, 300 + dx, 300 + dy]
            cases.append({"box_a": a, "box_b": [200, 200, 300, 300]})
    return cases


def geneval_reference(authors: Path, cases_per_tag: int, seed: int) -> dict:
    rng = random.Random(seed)
    classnames = [line.strip() for line in (authors / "object_names.txt").read_text().splitlines()]
    metadata_rows = [json.loads(line) for line in (authors / "evaluation_metadata.jsonl").read_text().splitlines() if line]
    by_tag: dict[str, list] = {}
    for row in metadata_rows:
        by_tag.setdefault(row["tag"], []).append(row)
    record: dict = {}
    _install_stubs(record)
    geneval = load_geneval_module(authors, record, classnames)
    server = load_reward_server(authors, classnames)
    image_path = Path(tempfile.mkdtemp()) / "0.png"
    Image.new("RGB", (SIDE, SIDE), "gray").save(image_path)
    cases = []
    for rows in by_tag.values():
        for metadata in rng.sample(rows, cases_per_tag):
            for nms in (1.0, 0.5):
                detections = _random_detections(rng, metadata, classnames)
                cases.append(_run_case(geneval, server, record, classnames, image_path, metadata, detections, nms))
    positions = []
    for case in _position_cases():
        rows = [np.array(case["box_a"] + [1.0]), np.array(case["box_b"] + [1.0])]
        relations = geneval["relative_position"]((rows[0], None), (rows[1], None))
        positions.append({**case, "relations": sorted(relations)})
    return {"source": "djghosh13/geneval@af4902f evaluation/evaluate_images.py; yifan123/reward-server@92ac29f "
                      "reward_server/gen_eval.py (run by experiments/rules_reference.py on recorded detections)",
            "cases": cases, "positions": positions}


def _run_case(geneval, server, record, classnames, image_path, metadata, detections, nms) -> dict:
    def bbox_arrays():
        arrays = []
        for name in classnames:
            items = detections.get(name, [])
            arrays.append(np.array([d["box"] + [d["score"]] for d in items], dtype=np.float32).reshape(-1, 5))
        return arrays

    # the authors keep float32 rows (mmdet's output): record colours under the same rounded values
    colours = {}
    for name, items in detections.items():
        for d in items:
            row = np.array(d["box"] + [d["score"]], dtype=np.float32)
            colours[(name, tuple(float(v) for v in row))] = d["colour"]
    stub = _colour_stub(colours)
    geneval["color_classification"] = stub
    server["color_classification"] = stub
    geneval["NMS_THRESHOLD"] = server["NMS_THRESHOLD"] = nms
    record["detections"] = lambda inputs: [bbox_arrays() for _ in inputs] if isinstance(inputs, list) else bbox_arrays()
    metric = geneval["evaluate_image"](str(image_path), metadata)
    reward = server["evaluate_image"]([Image.open(image_path)], [metadata], False)[0]
    as_float32 = {name: [{**d, "box": [float(v) for v in np.float32(d["box"])], "score": float(np.float32(d["score"]))}
                         for d in items] for name, items in detections.items()}
    return {
        "metadata": metadata,
        "nms_threshold": nms,
        "detections": as_float32,
        "kept": json.loads(metric["details"]),
        "correct": bool(metric["correct"]),
        "reason": metric["reason"],
        "reward_correct": bool(reward["correct"]),
        "strict_correct": bool(reward["strict_correct"]),
        "score": float(reward["score"]),
        "reward_reason": reward["reason"],
    }


# ---------------------------------------------------------------- OCR cases


def _ocr_lines(rng: random.Random, target: str) -> list | None:
    """What PaddleOCR 2.x's ``ocr()`` could return for an image meant to show ``target``."""
    kind = rng.choice(["exact", "case", "spaces", "typo", "drop", "extra", "split", "zero_conf", "none", "unrelated"])
    box = [[0, 0], [10, 0], [10, 10], [0, 10]]
    text = target
    if kind == "case":
        text = target.upper()
    elif kind == "spaces":
        text = target.replace(" ", "  ") + " "
    elif kind == "typo":
        chars = list(target)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(chars))
            chars[i] = rng.choice("abcxyz019!")
        text = "".join(chars)
    elif kind == "drop":
        text = target[: max(1, len(target) // 2)]
    elif kind == "extra":
        text = "SALE " + target + " now open"
    elif kind == "none":
        return [None]
    elif kind == "unrelated":
        text = "".join(rng.choice("qwertyuiopasdfghjkl ") for _ in range(3 * len(target) + 5))
    lines = [[box, (text, round(rng.uniform(0.5, 1.0), 3))]]
    if kind == "split" and " " in target:
        first, _, rest = target.partition(" ")
        lines = [[box, (first, 0.9)], [box, (rest, 0.8)]]
    if kind == "zero_conf":
        lines = [[box, (target, 0.0)], [box, ("fragment", 0.7)]]
    return [lines]


def ocr_reference(authors: Path, prompts: list[str], seed: int) -> dict:
    rng = random.Random(seed)
    record: dict = {}
    _install_stubs(record)
    sys.path.insert(0, str(authors))
    from ocr import OcrScorer  # the authors' module, importing the stub paddleocr and the real Levenshtein

    scorer = OcrScorer(use_gpu=False)
    cases = []
    for prompt in prompts:
        result = _ocr_lines(rng, prompt.split('"')[1])
        record["ocr"] = lambda image, result=result: result
        reward = scorer([np.zeros((8, 8, 3), dtype=np.uint8)], [prompt])[0]
        lines = [] if result[0] is None else [[text, conf] for _, (text, conf) in result[0]]
        cases.append({"prompt": prompt, "lines": lines, "reward": float(reward)})
    return {"source": "yifan123/flow_grpo@ac4c86e flow_grpo/ocr.py (run by experiments/rules_reference.py on recorded OCR lines)",
            "cases": cases}


DEFAULT_OCR_PROMPTS = [
    'A neon sign reading "Open 24 Hours" above a diner door',
    'A birthday cake with "Happy Birthday Anna" written in icing',
    'A chalkboard menu that says "Soup of the Day: Tomato"',
    'A runner\'s bib with the number "42"',
    'A coffee mug printed with "I <3 Mondays"',
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--authors", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("tests/data"))
    parser.add_argument("--cases-per-tag", type=int, default=12)
    parser.add_argument("--ocr-prompts", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=["geneval", "ocr", "colour"], default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    if args.only in (None, "geneval"):
        data = geneval_reference(args.authors, args.cases_per_tag, args.seed)
        (args.out / "geneval_rules_reference.json").write_text(json.dumps(data, indent=1) + "\n")
        print(f"geneval: {len(data['cases'])} cases, {sum(c['correct'] for c in data['cases'])} correct")
    if args.only in (None, "ocr"):
        source = args.authors / "ocr_prompts.txt"
        prompts = DEFAULT_OCR_PROMPTS
        if source.is_file():
            lines = [line.strip() for line in source.read_text().splitlines() if line.count('"') >= 2]
            prompts = DEFAULT_OCR_PROMPTS + random.Random(args.seed).sample(lines, args.ocr_prompts)
        data = ocr_reference(args.authors, prompts, args.seed)
        (args.out / "ocr_rule_reference.json").write_text(json.dumps(data, indent=1) + "\n")
        print(f"ocr: {len(data['cases'])} cases")
    if args.only == "colour":  # needs clip_benchmark and scikit-learn: run on its own
        data = colour_reference(args.authors, args.seed)
        (args.out / "geneval_colour_reference.json").write_text(json.dumps(data) + "\n")
        print(f"colour: {len(data['cases'])} images")



# ---------------------------------------------------------------- GenEval's colour classifier


def colour_reference(authors: Path, seed: int) -> dict:
    """The authors' color_classification (their ImageCrops, clip_benchmark's zero-shot classifier and
    run_classification, unchanged) on a tiny CLIP built from align/testing/tiny_judges.py, whose transformers model is
    wrapped in open_clip's encode_text / encode_image interface. Needs clip_benchmark (and scikit-learn, which
    it imports); the crops' pixels go through the project's open_clip preprocessing in both."""
    import base64
    import io

    import torch
    from clip_benchmark.metrics import zeroshot_classification as zsc

    from align.testing.tiny_judges import save_tiny_clip
    from rewards.geneval import load_clip_colours

    folder = Path(tempfile.mkdtemp()) / "clip"
    save_tiny_clip(folder, seed=0)
    ours = load_clip_colours(folder, device="cpu")
    embedder = ours.embedder

    class OpenClipInterface(torch.nn.Module):
        def encode_text(self, ids):
            return embedder.model.get_text_features(input_ids=ids).pooler_output

        def encode_image(self, pixels):
            return embedder.model.get_image_features(pixel_values=pixels).pooler_output

    def tokenizer(texts):
        return embedder.processor.tokenizer([embedder.clean_text(t) for t in texts], padding="max_length",
                                            max_length=embedder.max_tokens, return_tensors="pt")["input_ids"]

    record: dict = {}
    _install_stubs(record)
    sys.modules["clip_benchmark.metrics.zeroshot_classification"] = zsc  # the real one for this part
    classnames = [line.strip() for line in (authors / "object_names.txt").read_text().splitlines()]
    namespace = load_geneval_module(authors, record, classnames)
    # float32 throughout: the authors ran these under CUDA autocast (float16), clip_benchmark 1.6.2 would
    # autocast to bfloat16 on the CPU; the comparison is of the computation, the precision is a documented difference
    zsc_fp32 = types.SimpleNamespace(
        zero_shot_classifier=lambda *a, **k: zsc.zero_shot_classifier(*a, **{**k, "amp": False}),
        run_classification=lambda *a, **k: zsc.run_classification(*a, **{**k, "amp": False}))
    namespace.update(zsc=zsc_fp32, clip_model=OpenClipInterface(), tokenizer=tokenizer, DEVICE="cpu",
                     transform=lambda image: embedder.pixel_fn([image])[0], args=argparse.Namespace(options={}))
    rng = np.random.default_rng(seed)
    cases = []
    for index in range(6):
        height, width = int(rng.integers(40, 72)), int(rng.integers(40, 72))
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        image = Image.fromarray(pixels)
        objects = []
        for _ in range(int(rng.integers(1, 4))):
            x0, y0 = int(rng.integers(0, width - 12)), int(rng.integers(0, height - 12))
            x1, y1 = int(rng.integers(x0 + 8, width + 1)), int(rng.integers(y0 + 8, height + 1))
            mask = np.zeros((height, width), dtype=bool)
            mask[y0:y1, x0:x1] = rng.random((y1 - y0, x1 - x0)) < 0.7
            # a list, not mmdet's numpy row: Pillow 11+ compares a crop box with a tuple, which a numpy row refuses
            objects.append(([float(x0), float(y0), float(x1), float(y1), 0.9], mask if index % 2 == 0 else None))
        classname = ["cat", "photo", "red circle"][index % 3]
        colours = namespace["color_classification"](image, objects, classname)
        clf = namespace["COLOR_CLASSIFIERS"][classname]
        loader = torch.utils.data.DataLoader(namespace["ImageCrops"](image, objects), batch_size=16, num_workers=0)
        logits, _ = zsc_fp32.run_classification(namespace["clip_model"], clf, loader, "cpu")
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        cases.append({
            "image_png": base64.b64encode(buffer.getvalue()).decode(),
            "classname": classname,
            "objects": [{"box": [float(v) for v in row[:4]],
                         "mask": None if mask is None else np.packbits(mask).tolist(), "shape": [height, width]}
                        for row, mask in objects],
            "colours": colours,
            "logits": logits.tolist(),
        })
    return {"source": "djghosh13/geneval@af4902f color_classification with clip_benchmark 1.6.2's zero-shot classifier "
                      "on tests/tiny_judges.save_tiny_clip(seed=0) (experiments/rules_reference.py)",
            "cases": cases}


if __name__ == "__main__":
    main()
