"""Splash attention's block sizes on the chip: the causal kernel's forward and backward (the three gradients) timed
for each candidate `BlockSizes` at the attention shapes of the chip table's rows (benchmark).

    python3 bench/splash_blocks.py [--repeats 10] [--json OUT]      # on a TPU; --interpret runs tiny shapes anywhere

The step's kernel (models/splash.py) uses one block for everything (`block_size`: 512 where the length allows)
and a separate dq kernel. This prints, per shape, each candidate's milliseconds for the forward and for forward +
backward, and the ratio to the step's current choice, so a change of block sizes is chosen from measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT / "trainer")]

SHAPES = {
    "qwen3-0.6b 4x2048": (4, 16, 8, 2048),
    "qwen3-4b 2x2048": (2, 32, 8, 2048),
    "qwen3-4b 1x8192": (1, 32, 8, 8192),
}
"""(rows, query heads, key/value heads, length) with 128-wide heads, as one layer of each row runs it."""
TINY_SHAPES = {"tiny 1x512": (1, 2, 1, 512)}


def candidates(length: int) -> dict[str, dict]:
    """BlockSizes keyword sets: the step's current one first."""
    from lorajob_trainer.models import splash

    block = splash.block_size(length)
    same = dict(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
                block_kv_dkv_compute=block)
    found = {"current (one block, dq apart)": {**same, "block_q_dq": block, "block_kv_dq": block},
             "fused backward": {**same, "use_fused_bwd_kernel": True}}
    for kv in (1024, 2048):
        if length % kv == 0 and kv > block:
            found[f"kv {kv}, fused"] = {**same, "block_kv": kv, "block_kv_dkv": kv, "use_fused_bwd_kernel": True}
            found[f"q {kv} kv {kv}, fused"] = {**same, "block_q": kv, "block_kv": kv, "block_q_dkv": kv,
                                               "block_kv_dkv": kv, "use_fused_bwd_kernel": True}
            found[f"kv {kv}, dq apart"] = {**same, "block_kv": kv, "block_kv_dkv": kv, "block_q_dq": block,
                                          "block_kv_dq": kv}
    if block > 256:
        found["256, fused"] = {key: 256 for key in same} | {"use_fused_bwd_kernel": True}
    return found


def timed(function, arguments, repeats: int) -> float:
    import jax

    jax.block_until_ready(function(*arguments))
    started = time.perf_counter()
    for _ in range(repeats):
        out = function(*arguments)
    jax.block_until_ready(out)
    return (time.perf_counter() - started) / repeats


def measure(shape: tuple[int, int, int, int], sizes: dict, repeats: int, interpret: bool) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

    rows, heads, kv_heads, length = shape
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((length, length)) for _ in range(heads)])
    kernel = splash_kernel.make_splash_mha(mask, block_sizes=splash_kernel.BlockSizes(**sizes), head_shards=1,
                                           q_seq_shards=1, interpret=interpret)
    keys = jax.random.split(jax.random.key(0), 3)
    query = jax.random.normal(keys[0], (rows, heads, length, 128), jnp.bfloat16)
    key = jax.random.normal(keys[1], (rows, kv_heads, length, 128), jnp.bfloat16)
    value = jax.random.normal(keys[2], (rows, kv_heads, length, 128), jnp.bfloat16)
    segments = jnp.ones((rows, length), jnp.int32)

    def forward(q, k, v):
        return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash_kernel.SegmentIds(s, s)))(q, k, v, segments)

    def loss(q, k, v):
        return forward(q, k, v).astype(jnp.float32).sum()

    forward_jit, backward_jit = jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return {"forward_ms": 1e3 * timed(forward_jit, (query, key, value), repeats),
            "forward_backward_ms": 1e3 * timed(backward_jit, (query, key, value), repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json")
    parser.add_argument("--interpret", action="store_true", help="Pallas' interpreter on tiny shapes (any backend)")
    args = parser.parse_args()
    results = []
    for shape_name, shape in (TINY_SHAPES if args.interpret else SHAPES).items():
        baseline = None
        for name, sizes in candidates(shape[3]).items():
            try:
                figures = measure(shape, sizes, args.repeats, args.interpret)
            except Exception as error:  # noqa: BLE001 - a block combination the kernel refuses: say so, go on
                figures = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
            baseline = baseline or figures.get("forward_backward_ms")
            result = {"shape": shape_name, "candidate": name, "sizes": sizes, **figures}
            results.append(result)
            if "error" in figures:
                print(f"{shape_name:18} {name:30} {figures['error']}", flush=True)
            else:
                print(f"{shape_name:18} {name:30} fwd {figures['forward_ms']:7.2f} ms  fwd+bwd "
                      f"{figures['forward_backward_ms']:7.2f} ms  x{figures['forward_backward_ms'] / baseline:.2f}",
                      flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
