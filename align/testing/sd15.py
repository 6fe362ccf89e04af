"""Stable Diffusion v1.5's UNet config (stable-diffusion-v1-5/stable-diffusion-v1-5 unet/config.json values),
for benchmarks that build the real architecture with random weights, offline."""

SD15_UNET = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768,
    attention_head_dim=8,
    norm_num_groups=32,
)
