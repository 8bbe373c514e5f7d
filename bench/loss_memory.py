"""Memory and time of the loss at real vocabularies: full logits + log-softmax (before) vs the chunked loss (now).

    python bench/loss_memory.py [--vocabs 151936,262144] [--batch 1] [--seq 1024] [--hidden 512] [--layers 2]
                                [--trained 0.5] [--chunk N] [--steps 3] [--single-thread]

A Qwen3 of `--layers` layers, `--hidden` wide, with an untied LM head of each vocabulary size (random
weights, LoRA r16 on all seven projections). One row of the batch trains on its last `--trained`
fraction of positions (an SFT answer after its prompt). Measured: the loss and its gradient with
respect to the adapters (what one micro-batch of a train step computes), each variant in a child
process of its own. Printed per variant: XLA's temporary buffer size of the compiled computation
(what the logits cost, independent of the allocator), peak memory (device peak on an accelerator,
peak RSS on CPU), median time of `--steps` runs after one warm-up, and the loss (equal for both).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from trainer_bench import QWEN3, bench_dtype, random_lora_model, run_child

from lorajob_trainer.contract.config import default_loss_chunk
from lorajob_trainer.metrics import peak_device_memory_bytes, peak_host_memory_bytes

LOSSES = ("full-logits", "chunked")


def full_logits_losses(model, batch):
    """The loss as the trainer computed it before chunking: all [B, L, V] logits, then a log-softmax."""
    import jax
    import jax.numpy as jnp

    from lorajob_trainer import models

    logits = models.forward(model, batch["inputs"], batch["positions"], batch["segment_ids"])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.sum(nll * batch["weights"]), jnp.sum(batch["weights"])


def measure(args) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from lorajob_trainer import loss as loss_lib
    from lorajob_trainer import mesh as mesh_lib
    from lorajob_trainer.contract.config import MeshConfig

    hf = {**QWEN3, "vocab_size": args.vocab, "hidden_size": args.hidden, "intermediate_size": 3 * args.hidden,
          "num_hidden_layers": args.layers, "num_attention_heads": 8, "num_key_value_heads": 4,
          "head_dim": args.hidden // 8, "tie_word_embeddings": False}
    mesh = mesh_lib.build_mesh(MeshConfig())
    model, _ = random_lora_model(hf, 16, bench_dtype(), mesh)
    graphdef, adapters, base = nnx.split(model, nnx.LoRAParam, ...)
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq + 1), 0, args.vocab, jnp.int32)
    prompt = round(args.seq * (1 - args.trained))
    batch = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "weights": jnp.broadcast_to((jnp.arange(args.seq) >= prompt).astype(jnp.float32), (args.batch, args.seq)),
        "segment_ids": jnp.ones((args.batch, args.seq), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(args.seq, dtype=jnp.int32), (args.batch, args.seq)),
    }
    if args.loss == "chunked":
        def losses(model, batch):
            return loss_lib.token_losses(model, batch, args.chunk)
    else:
        losses = full_logits_losses

    def loss_and_grad(adapters, base, batch):
        return jax.value_and_grad(lambda a: losses(nnx.merge(graphdef, a, base), batch), has_aux=True)(adapters)

    with jax.set_mesh(mesh):
        compiled = jax.jit(loss_and_grad).lower(adapters, base, batch).compile()
        analysis = compiled.memory_analysis()
        (loss, _), grads = compiled(adapters, base, batch)
        jax.block_until_ready(grads)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            jax.block_until_ready(compiled(adapters, base, batch))
            times.append(time.perf_counter() - start)
    device_peak = peak_device_memory_bytes(jax.local_devices())
    return {
        "loss": args.loss, "vocab": args.vocab, "temp_bytes": analysis.temp_size_in_bytes if analysis else None,
        "peak_bytes": device_peak if device_peak is not None else peak_host_memory_bytes(),
        "peak_kind": "device" if device_peak is not None else "RSS", "step_s": statistics.median(times),
        "value": float(loss),
    }


def report(args, results: list[dict]) -> None:
    print(f"loss + adapter gradient: batch={args.batch} seq={args.seq} hidden={args.hidden} layers={args.layers} "
          f"trained={args.trained:.0%} chunk={args.chunk} steps={args.steps}")
    print(f"  {'vocab':>7}  {'loss':<11} {'XLA temp':>10} {'peak':>16} {'time':>10}  {'loss value':>10}")
    for result in results:
        temp = f"{result['temp_bytes'] / 2**30:.2f} GiB" if result["temp_bytes"] is not None else "n/a"
        print(f"  {result['vocab']:>7}  {result['loss']:<11} {temp:>10} "
              f"{result['peak_bytes'] / 2**30:>8.2f} GiB {result['peak_kind']:<6} {1000 * result['step_s']:>7.0f} ms  "
              f"{result['value']:>10.4f}")
    for vocab in args.vocabs:
        pair = {r["loss"]: r for r in results if r["vocab"] == vocab}
        if set(pair) == set(LOSSES):
            before, after = pair["full-logits"], pair["chunked"]
            temp = (f"XLA temp {before['temp_bytes'] / after['temp_bytes']:.1f}x smaller, "
                    if before["temp_bytes"] and after["temp_bytes"] else "")
            print(f"  vocab {vocab}: {temp}peak {before['peak_bytes'] / after['peak_bytes']:.2f}x smaller, "
                  f"time {after['step_s'] / before['step_s']:.2f}x of before")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabs", type=lambda text: [int(v) for v in text.split(",")], default=[151936, 262144])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--trained", type=float, default=0.5, help="fraction of each row with loss weight 1")
    parser.add_argument("--chunk", type=int, default=None,
                        help="loss_chunk_length (default: the trainer's for --batch rows)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument("--single-thread", action="store_true", help="CPU: one XLA thread")
    parser.add_argument("--loss", choices=LOSSES, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.chunk = args.chunk or default_loss_chunk(args.batch)
    if args.loss:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    results = [
        run_child(__file__, [*sys.argv[1:], "--loss", loss, "--vocab", str(vocab)], args.single_thread)
        for vocab in args.vocabs
        for loss in args.losses.split(",")
    ]
    report(args, results)


if __name__ == "__main__":
    main()
