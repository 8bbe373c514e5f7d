"""MaxText's per-chip HBM for one train step, compiled deviceless for a TPU topology (benchmark, not CI).

    python bench/maxtext/train_compile.py --model llama3.1-8b --topology v6e-8 --seq 1024 --lora

runs `maxtext.trainers.pre_train.train_compile` (through `train_compile_wrapper.py`) in MaxText's venv
from `setup.sh`, with the libtpu that `setup.sh` installs apart from that venv on PYTHONPATH for this run
only, and prints one JSON line: the compiler's per-chip argument / output / alias / temp bytes, their total
(`argument + output - alias + temp`: donated inputs that the outputs reuse counted once), the cost
analysis' flops (a scanned layer body counted once: MaxText scans its layers by default), what each device
sends per step by collective kind (from the compiled HLO, by the trainer's own reader), the compile time, or, when
it does not compile, the reason. Stdlib only, so any interpreter runs it; `run()` gives the
same dict to another bench script.

With `--lora` (the default) the wrapper adds MaxText's own LoRA adapters, which `train_compile` alone never
does (it would compile a step with nothing to train: a forward pass); see train_compile_wrapper.py.
"""

import argparse
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WRAPPER = os.path.join(HERE, "train_compile_wrapper.py")
MARKER = "LORAJOB_TRAIN_COMPILE_RESULT "
HLO_PATH_VARIABLE = "LORAJOB_TRAIN_COMPILE_HLO"
"""The wrapper writes the compiled step's HLO text to the file this variable names."""
COLLECTIVES = os.path.join(HERE, "..", "..", "trainer", "lorajob_trainer", "collectives.py")
"""The trainer's reader of a compiled step's collectives (stdlib only), loaded by path: the same count as ours."""
TOTAL_FORMULA = "argument + output - alias + temp"
FLOPS_NOTE = "cost_analysis()['flops']; a scanned layer body is counted once"


def collective_bytes(hlo_text):
    """What one device sends per step, by collective kind, as the trainer's plan counts it for its own step."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lorajob_collectives", COLLECTIVES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {kind: sent for kind, sent in module.collective_bytes(hlo_text).items() if sent}


def maxtext_home():
    return os.environ.get("LORAJOB_MAXTEXT_HOME", os.path.expanduser("~/.cache/lorajob-maxtext"))


def _site_packages(home):
    found = sorted(glob.glob(os.path.join(home, "venv", "lib", "python3*", "site-packages")))
    if not found:
        raise FileNotFoundError(f"no MaxText venv under {home}; run bench/maxtext/setup.sh")
    return found[-1]


def _installed_version(site_packages, package):
    found = glob.glob(os.path.join(site_packages, f"{package}-*.dist-info"))
    if not found:
        raise FileNotFoundError(f"{package} is not installed in {site_packages}")
    return os.path.basename(found[0])[len(package) + 1 : -len(".dist-info")]


def default_libtpu_dir(home):
    """The folder setup.sh installs libtpu into: the version the venv's jax pins in its `tpu` extra."""
    return os.path.join(home, f"libtpu-jax{_installed_version(_site_packages(home), 'jax')}")


def maxtext_args(model, topology, num_slices=1, batch=1, seq=1024, rank=16, alpha=32.0,
                 weight_dtype="float32", lora=True, package_dir=None, extra=()):
    """`train_compile`'s command-line arguments (after the module name) for one compile."""
    args = [
        os.path.join(package_dir, "configs", "base.yml"),
        f"compile_topology={topology}",
        f"compile_topology_num_slices={num_slices}",
        f"model_name={model}",
        f"per_device_batch_size={batch:g}",
        f"max_target_length={seq}",
        f"weight_dtype={weight_dtype}",
    ]
    if lora:
        args += ["lora.enable_lora=True", f"lora.lora_rank={rank}", f"lora.lora_alpha={alpha:g}"]
    return args + list(extra)


def _failure_reason(output, wrapper_error):
    """The compiler's or MaxText's own words: RESOURCE_EXHAUSTED's message, else the last exception line."""
    text = wrapper_error or output
    exhausted = re.search(r"RESOURCE_EXHAUSTED:.*?(?=\n\s*\n|\Z)", text, re.S)
    if exhausted:
        return exhausted.group(0).strip()[:1500]
    if wrapper_error:
        return wrapper_error[:1500]
    exceptions = list(re.finditer(r"^(?:[\w.]+(?:Error|Exception|Exit)|AssertionError|KeyError)\b.*$", output, re.M))
    if exceptions:
        lines = output[exceptions[-1].start():].splitlines()
        reason = lines[0]
        if reason.endswith(":"):  # the message goes on after a line break (e.g. JAX's scan carry mismatch)
            reason += " " + next((line.strip() for line in lines[1:] if line.strip()), "")
        return reason[:1500]
    tail = [line for line in output.splitlines() if line.strip()][-5:]
    return "\n".join(tail)[:1500] or "no output"


def run(model, topology, num_slices=1, batch=1, seq=1024, rank=16, alpha=32.0, weight_dtype="float32",
        lora=True, timeout_s=900, extra=(), home=None, libtpu_dir=None, niceness=19, log=None):
    """Compiles MaxText's train step for `topology` without its chips; returns the figures as a dict.

    `log`: a file to write MaxText's whole output to.
    """
    home = home or maxtext_home()
    site_packages = _site_packages(home)
    package_dir = os.path.join(site_packages, "maxtext")
    libtpu_dir = libtpu_dir or os.environ.get("LORAJOB_MAXTEXT_LIBTPU") or default_libtpu_dir(home)
    result = {
        "model": model, "topology": topology, "num_slices": num_slices, "batch": batch, "seq": seq,
        "mode": "lora" if lora else "full", "rank": rank if lora else None, "alpha": alpha if lora else None,
        "weight_dtype": weight_dtype, "ok": False,
    }
    models_dir = os.path.join(package_dir, "configs", "models")
    if not os.path.isfile(os.path.join(models_dir, f"{model}.yml")):
        known = sorted(os.path.basename(path)[: -len(".yml")] for path in glob.glob(os.path.join(models_dir, "*.yml")))
        prefix = re.match(r"[a-z]*", model.lower()).group(0)
        family = [name for name in known if prefix and name.startswith(prefix)]
        result["reason"] = f"MaxText has no model config {model!r}; same family: {family or known}"
        return result
    if not os.path.isdir(os.path.join(libtpu_dir, "libtpu")):
        result["reason"] = f"no libtpu in {libtpu_dir}; run bench/maxtext/setup.sh"
        return result

    args = maxtext_args(model, topology, num_slices, batch, seq, rank, alpha, weight_dtype, lora, package_dir, extra)
    # Not the TPU_* variables libtpu's Python side writes into a process that loaded it without a TPU (e.g.
    # TPU_WORKER_HOSTNAMES holding a warning's text): inherited, they make this compile fail ("Could not convert
    # JSON string to proto") when bench/tpu_plan.py compiled our step first in its own process.
    env = {key: value for key, value in os.environ.items() if not key.startswith("TPU_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [libtpu_dir, env.get("PYTHONPATH")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    # libtpu takes /tmp/libtpu_lockfile for its process's lifetime; a compile needs no chip, so it may run
    # beside another libtpu process (e.g. a compile of our trainer's step).
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    command = [os.path.join(home, "venv", "bin", "python"), WRAPPER, *args]
    result["maxtext_args"] = " ".join(args[1:])
    with tempfile.TemporaryDirectory() as scratch:
        env[HLO_PATH_VARIABLE] = hlo_path = os.path.join(scratch, "step.hlo")
        started = time.perf_counter()
        process = subprocess.Popen(
            command, cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, preexec_fn=(lambda: os.nice(niceness)) if niceness else None,
        )
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the session started above: the compile and its children
            output, _ = process.communicate()
            if log:
                with open(log, "w") as handle:
                    handle.write(output)
            result["wall_s"] = round(time.perf_counter() - started, 1)
            result["reason"] = f"timeout after {timeout_s} s"
            return result
        result["wall_s"] = round(time.perf_counter() - started, 1)
        if os.path.isfile(hlo_path):
            with open(hlo_path) as handle:
                result["collective_bytes"] = collective_bytes(handle.read())
    if log:
        with open(log, "w") as handle:
            handle.write(output)

    measured = {}
    for line in output.splitlines():
        if line.startswith(MARKER):
            measured = json.loads(line[len(MARKER):])
    if "versions" in measured:
        result["versions"] = measured["versions"]
    if "compile_s" in measured:
        result["compile_s"] = measured["compile_s"]
    for key in ("lora_params", "lora_param_arrays", "lora_modules"):
        if key in measured:
            result[key] = measured[key]
    memory = measured.get("memory")
    if memory is None or process.returncode != 0:
        result["returncode"] = process.returncode
        if process.returncode < 0 and not measured.get("error"):
            result["reason"] = (
                f"killed by signal {-process.returncode} after {result['wall_s']} s"
                + (" (SIGKILL: usually the host's OOM killer, see dmesg)" if process.returncode == -9 else "")
            )
        else:
            result["reason"] = _failure_reason(output, measured.get("error"))
        return result

    result["ok"] = True
    for key in ("argument", "output", "alias", "temp", "generated_code"):
        result[f"{key}_bytes"] = memory[f"{key}_size_in_bytes"]
    if memory.get("peak_memory_in_bytes"):
        result["peak_bytes"] = memory["peak_memory_in_bytes"]
    host = {key: memory[key] for key in memory if key.startswith("host_") and memory[key]}
    if host:
        result["host"] = host
    result["total_per_chip_bytes"] = (
        memory["argument_size_in_bytes"] + memory["output_size_in_bytes"]
        - memory["alias_size_in_bytes"] + memory["temp_size_in_bytes"]
    )
    result["total_formula"] = TOTAL_FORMULA
    cost = measured.get("cost") or {}
    if cost.get("flops") is not None:
        result["flops"] = cost["flops"]
        result["flops_note"] = FLOPS_NOTE
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="MaxText model name (configs/models/<name>.yml)")
    parser.add_argument("--topology", required=True, help="MaxText compile_topology: v6e-8, v5p-8, tpu7x-8, ...")
    parser.add_argument("--num-slices", type=int, default=1)
    parser.add_argument("--batch", type=float, default=1, help="per device")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--weight-dtype", default="float32", choices=("float32", "bfloat16"))
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--lora", dest="lora", action="store_true", default=True, help="LoRA step (default)")
    mode.add_argument("--full", dest="lora", action="store_false", help="full fine-tune step")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for the whole MaxText process")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another MaxText setting (repeatable), e.g. --set scan_layers=False")
    parser.add_argument("--log", help="write MaxText's whole output to this file")
    parser.add_argument("--libtpu-dir", help="libtpu folder (default: setup.sh's, for the venv's jax)")
    options = parser.parse_args(argv)
    batch = int(options.batch) if options.batch == int(options.batch) else options.batch
    result = run(options.model, options.topology, options.num_slices, batch, options.seq, options.rank,
                 options.alpha, options.weight_dtype, options.lora, options.timeout, options.set,
                 libtpu_dir=options.libtpu_dir, log=options.log)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
