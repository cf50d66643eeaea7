"""Qwen3.5's vision tower (backends/common/model/vision.py) against transformers' own `Qwen3_5VisionModel` (sdpa)
on the same card in the same run: images per second at each size and batch, and the largest difference of their
rows.

    python perf/engine.py vision [--sizes 448 1344] [--images 1 4] [--reps 10] [--out FILE.md]

Both towers take the same random weights (the published tower's shape: `random:qwen3.5-9b`'s, 27 blocks of 1152,
patches of 16 merged 2 x 2) in bf16 and the same preprocessed images (Qwen3-VL's processor on random square
pictures of the given side). A batch of N images is one call of each tower; a call's time is the median of
`--reps` calls, each between its own CUDA events (perf.tools.timing). `--cpu` (float32, small depth) only checks
that the script runs."""

from __future__ import annotations

import argparse
import io
import sys
from dataclasses import replace

import numpy as np
import torch

from perf.tools.limits import bounded_report, finish, needs_cuda
from perf.tools.timing import cuda_median, wall_median


def picture(side: int, seed: int) -> bytes:
    from PIL import Image

    rgb = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def hf_tower(vc, weights: dict, dtype, device):
    """transformers' Qwen3_5VisionModel with the same weights (sdpa attention)."""
    import transformers as tf

    cfg = tf.Qwen3_5VisionConfig(
        depth=vc.depth, hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size, num_heads=vc.num_heads,
        patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size, spatial_merge_size=vc.spatial_merge_size,
        out_hidden_size=vc.out_hidden_size, num_position_embeddings=vc.num_position_embeddings,
        hidden_act=vc.hidden_act,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    model = tf.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel(cfg).to(device=device, dtype=dtype).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"weights do not fit transformers' tower: missing {missing}, unexpected {unexpected}")
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[448, 1344], help="square images of this side (pixels)")
    ap.add_argument("--images", type=int, nargs="+", default=[1, 4], help="images per call")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cpu", action="store_true", help="float32 on the CPU, 2 blocks: a smoke run")
    ap.add_argument("--time-limit", type=float, default=300, help="wall-clock bound; what was measured is written")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not a.cpu and needs_cuda("vision_bench"):
        return 2
    from backends.common.model.loader import resolve
    from backends.common.model.multimodal import image_processor_for
    from backends.common.model.vision import VisionTower, random_vision_weights

    device, dtype = ("cpu", torch.float32) if a.cpu else ("cuda", torch.bfloat16)
    proc, _ = image_processor_for(resolve("random:qwen3.5-9b"), max_pixels=max(a.sizes) ** 2)
    vc = replace(proc.vc, depth=2) if a.cpu else proc.vc
    weights = random_vision_weights(vc, dtype, device)
    ours, theirs = VisionTower(vc, weights), hf_tower(vc, weights, dtype, device)
    where = "CPU (float32)" if a.cpu else f"{torch.cuda.get_device_name()} (bf16)"
    rows: list[dict] = []
    lines = [
        f"# Vision tower on {where}: ours vs transformers' Qwen3_5VisionModel (sdpa), {vc.depth} blocks of "
        f"{vc.hidden_size}",
        "",
        f"Command: `python perf/engine.py vision {' '.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        "| image side | images | tokens | ours | images/s | transformers | images/s | ours / transformers | max diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    write, timer = bounded_report(lines, a.out, rows, a.time_limit)
    timed = (lambda fn: wall_median(fn, a.reps)) if a.cpu else (lambda fn: cuda_median(fn, a.reps))
    for side in a.sizes:
        for n in a.images:
            images = proc([picture(side, i) for i in range(n)])
            pixels = torch.cat([im.pixel_values for im in images]).to(device, dtype)
            grid = torch.tensor([im.grid_thw for im in images], device=device)
            with torch.inference_mode():
                mine = torch.cat(ours.encode(pixels, grid.cpu()))
                ref = theirs(pixels, grid_thw=grid).pooler_output
                t_ours = timed(lambda x=pixels, g=grid: ours.encode(x, g.cpu()))
                t_ref = timed(lambda x=pixels, g=grid: theirs(x, grid_thw=g))
            diff = (mine.float() - ref.float()).abs().max().item()
            rows.append(dict(side=side, images=n, tokens=mine.shape[0], ours_s=t_ours, hf_s=t_ref, max_diff=diff))
            lines.append(
                f"| {side} | {n} | {mine.shape[0]} | {t_ours * 1e3:.2f} ms | {n / t_ours:.1f} | {t_ref * 1e3:.2f} ms "
                f"| {n / t_ref:.1f} | **{t_ref / t_ours:.2f}x** | {diff:.1e} |"
            )
            write()
    return finish(timer, lines, write)


if __name__ == "__main__":
    sys.exit(main())
