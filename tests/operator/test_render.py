"""Rendering LoRAJob specs into JobSets: names, labels, ownership, credentials and the per-backend shapes."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
from builders import GPU, NAMESPACE, UID, compute, lorajob, owner, parsed, spec_dict

from lorajob_operator import accelerators, jobsets, names, rules, step_commands, validation
from lorajob_operator.settings import Images, RenderSettings
from lorajob_trainer.contract.config import TrackingConfig, TrainConfig

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
SETTINGS = RenderSettings()
BACKENDS = ("pathways", "mcjax", "gpu")


def _rendered(body: dict, settings: RenderSettings = SETTINGS) -> dict[str, dict]:
    return {js["metadata"]["labels"][names.LABEL_PHASE]: js for js in jobsets.render_all(parsed(body), owner(body), settings)}


def _pod_templates(jobset: dict) -> dict[str, dict]:
    return {rjob["name"]: rjob["template"]["spec"]["template"] for rjob in jobset["spec"]["replicatedJobs"]}


def _env(container: dict) -> dict[str, dict]:
    return {item["name"]: item for item in container.get("env", [])}


MAXTEXT_BASE = {"name": "qwen3-0.6b", "maxtextCheckpoint": "gs://b/base/0/items"}


def _longest_name_spec(backend: str, model: dict | None = None) -> tuple[str, dict]:
    """A spec running convert (or, from a MaxText `model`, check), train and export, and the longest run name the
    CRD admits for it."""
    spec = spec_dict(compute=compute(backend, slices=64, topology="16x16" if backend != "gpu" else "4x4"))
    if model:
        spec["model"] = model
    if backend == "gpu":
        spec["compute"] = {"backend": "gpu", "gpu": {**GPU, "nodes": 512}}
    limit = rules.run_name_limit(parsed(lorajob(spec=spec))).limit
    return "r" + "x" * (limit - 1), spec


@pytest.mark.parametrize("model", [None, MAXTEXT_BASE], ids=["convert", "check"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_names_and_labels_stay_within_kubernetes_limits_at_the_longest_allowed_run_name(backend, model):
    name, spec = _longest_name_spec(backend, model)
    jobsets = _rendered(lorajob(name, spec))
    assert set(jobsets) == {"check" if model else "convert", "train", "export"}
    for phase, jobset in jobsets.items():
        assert jobset["metadata"]["name"] == names.child_name(name, phase)
        assert len(jobset["metadata"]["name"]) <= names.WORKLOAD_NAME_MAX
        for rjob in jobset["spec"]["replicatedJobs"]:
            # The JobSet webhook's own checks: <jobset>-<rjob>-<lastJob> and <...>-<lastPod>-abcde are DNS-1035 labels.
            job = f"{jobset['metadata']['name']}-{rjob['name']}-{rjob['replicas'] - 1}"
            pod = f"{job}-{rjob['template']['spec']['completions'] - 1}-abcde"
            for generated in (job, pod):
                assert DNS1035.match(generated) and len(generated) <= 63, generated
        if "coordinator" in jobset["spec"]:
            coordinator = jobset["spec"]["coordinator"]
            value = f"{jobset['metadata']['name']}-{coordinator['replicatedJob']}-0-0.{jobset['metadata']['name']}"
            assert len(value) <= 63, value
        labels = [jobset["metadata"]["labels"], *(t["metadata"]["labels"] for t in _pod_templates(jobset).values())]
        for label_set in labels:
            for key, value in label_set.items():
                assert len(value) <= 63 and names.allowed_label(key), (key, value)


def test_parent_labels_and_annotations_are_never_copied_to_children():
    body = lorajob(
        labels={"app.kubernetes.io/instance": "argocd-app", "cost-center": "cc-1234"},
        annotations={"kubectl.kubernetes.io/last-applied-configuration": "{}", "argocd.argoproj.io/tracking-id": "x"},
    )
    for jobset in _rendered(body).values():
        assert "annotations" not in jobset["metadata"]
        text = repr(jobset)
        for foreign in ("argocd", "app.kubernetes.io", "last-applied", "cost-center", "cc-1234"):
            assert foreign not in text


def test_children_are_controlled_by_the_lorajob():
    for jobset in _rendered(lorajob()).values():
        assert jobset["metadata"]["namespace"] == NAMESPACE
        assert jobset["metadata"]["ownerReferences"] == [{
            "apiVersion": "lorajob.dev/v1alpha1", "kind": "LoRAJob", "name": "qwen3-gsm8k", "uid": UID,
            "controller": True, "blockOwnerDeletion": True,
        }]


def test_queue_and_priority_labels_are_on_the_jobset_only():
    spec = spec_dict(scheduling={"queueName": "research", "priorityClass": "high"})
    for jobset in _rendered(lorajob(spec=spec)).values():
        assert jobset["metadata"]["labels"][names.KUEUE_QUEUE_LABEL] == "research"
        assert jobset["metadata"]["labels"][names.KUEUE_PRIORITY_LABEL] == "high"
        assert "suspend" not in jobset["spec"]  # Kueue's webhook suspends it; the operator never touches suspend
        for template in _pod_templates(jobset).values():
            assert not any(key.startswith("kueue.x-k8s.io/") for key in template["metadata"]["labels"])


def test_without_a_queue_there_are_no_kueue_labels():
    spec = spec_dict(scheduling=None)
    for jobset in _rendered(lorajob(spec=spec)).values():
        assert not any(key.startswith("kueue.x-k8s.io/") for key in jobset["metadata"]["labels"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_hugging_face_token_only_travels_as_a_secret_key_reference(backend):
    spec = spec_dict(compute=compute(backend), credentials={"huggingFaceToken": {"name": "hf", "key": "token"}})
    for jobset in _rendered(lorajob(spec=spec)).values():
        for template in _pod_templates(jobset).values():
            for container in template["spec"]["containers"] + template["spec"].get("initContainers", []):
                env = _env(container)
                if container["name"] == names.TRAINER_CONTAINER:
                    assert env["HF_TOKEN"] == {
                        "name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token", "optional": True}}
                    }
                    assert env["LORAJOB_HF_TOKEN_SECRET"] == {"name": "LORAJOB_HF_TOKEN_SECRET", "value": "hf/token"}
                else:
                    assert "HF_TOKEN" not in env


@pytest.mark.parametrize(
    ("model", "lora", "export", "expected"),
    [
        ({"name": "qwen3-0.6b", "huggingFace": "Qwen/Qwen3-0.6B"}, {}, {}, ["convert", "train", "export"]),
        ({"name": "qwen3-0.6b", "maxtextCheckpoint": "gs://b/base/0/items"}, {}, {}, ["check", "train", "export"]),
        ({"name": "qwen3-0.6b", "maxtextCheckpoint": "gs://b/base/0/items"}, {}, {"enabled": False}, ["check", "train"]),
        (
            {"name": "qwen3-0.6b", "maxtextCheckpoint": "gs://b/base/0/items"},
            {"restoreFrom": {"huggingFace": "org/adapter"}}, {"enabled": False}, ["convert", "train"],
        ),
    ],
    ids=["hf-base", "trainer-base", "no-export", "hf-adapter-only"],
)
def test_steps_the_spec_does_not_need_are_skipped(model, lora, export, expected):
    spec = spec_dict(model=model, lora=lora, export=export)
    assert [js["metadata"]["labels"][names.LABEL_PHASE] for js in jobsets.render_all(parsed(lorajob(spec=spec)), owner(lorajob()), SETTINGS)] == expected


def test_pathways_train_has_the_gke_shape():
    spec = spec_dict(compute={"backend": "pathways", "tpu": {"machineType": "ct6e-standard-4t", "topology": "4x8", "slices": 2}})
    jobset = _rendered(lorajob(spec=spec))["train"]
    assert jobset["metadata"]["name"] == "qwen3-gsm8k"
    assert jobset["spec"]["coordinator"] == {"replicatedJob": "pathways-head", "jobIndex": 0, "podIndex": 0}
    assert jobset["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["pathways-head"]}
    head_rjob, worker_rjob = jobset["spec"]["replicatedJobs"]
    assert (head_rjob["name"], head_rjob["replicas"], head_rjob["template"]["spec"]["parallelism"]) == ("pathways-head", 1, 1)

    head = head_rjob["template"]["spec"]["template"]["spec"]
    assert head["nodeSelector"] == {"cloud.google.com/gke-nodepool": "cpu-np"}
    assert [(c["name"], c["restartPolicy"]) for c in head["initContainers"]] == [("pathways-rm", "Always"), ("pathways-proxy", "Always")]
    rm = head["initContainers"][0]
    assert "--instance_count=2" in rm["args"] and "--instance_type=tpuv6e:4x8" in rm["args"]
    (trainer,) = head["containers"]
    env = _env(trainer)
    assert env["JAX_PLATFORMS"]["value"] == "proxy"
    assert env["JAX_BACKEND_TARGET"]["value"] == "grpc://$(PATHWAYS_HEAD):29000"
    assert env["ENABLE_PATHWAYS_PERSISTENCE"]["value"] == "1"
    assert env["PATHWAYS_HEAD"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['jobset.sigs.k8s.io/coordinator']"
    assert trainer["command"][:3] == ["python", "-m", "lorajob_trainer.train"]
    assert "google.com/tpu" not in repr(head)

    assert worker_rjob["name"] == "worker" and worker_rjob["replicas"] == 2  # one Job per slice
    assert worker_rjob["template"]["metadata"]["annotations"] == {names.EXCLUSIVE_TOPOLOGY: "cloud.google.com/gke-nodepool"}
    vms = accelerators.vms_per_slice("ct6e-standard-4t", "4x8")
    assert worker_rjob["template"]["spec"]["parallelism"] == worker_rjob["template"]["spec"]["completions"] == vms == 8
    worker = worker_rjob["template"]["spec"]["template"]["spec"]
    assert worker["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice", "cloud.google.com/gke-tpu-topology": "4x8"}
    assert worker["tolerations"] == [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
    (server,) = worker["containers"]
    assert server["resources"]["requests"] == {"google.com/tpu": "4"}
    worker_env = _env(server)
    for name in ("MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "PATHWAYS_HEAD"):
        assert "valueFrom" in worker_env[name], name


def _process_id(container: dict, job_index: int, completion_index: int) -> int:
    """Run the container's command with the trainer replaced by a probe: the JAX_PROCESS_ID it would get."""
    shell, flag, script, *trainer = container["command"]
    assert trainer[:3] == ["python", "-m", "lorajob_trainer.train"]
    probe = [sys.executable, "-c", "import os; print(os.environ['JAX_PROCESS_ID'])"]
    env = {"JOB_INDEX": str(job_index), "JOB_COMPLETION_INDEX": str(completion_index), "PATH": "/usr/bin:/bin"}
    return int(subprocess.run([shell, flag, script, *probe], env=env, capture_output=True, text=True, check=True).stdout)


@pytest.mark.parametrize("backend", ["mcjax", "gpu"])
def test_multi_controller_train_has_no_head_and_a_jax_coordinator(backend):
    spec = spec_dict(compute=compute(backend, slices=2))
    jobset = _rendered(lorajob(spec=spec))["train"]
    (rjob,) = jobset["spec"]["replicatedJobs"]
    assert rjob["name"] == "worker" and "coordinator" not in jobset["spec"]
    pod = rjob["template"]["spec"]["template"]["spec"]
    (trainer,) = pod["containers"]
    env = _env(trainer)
    assert env["JAX_COORDINATOR_ADDRESS"]["value"] == "qwen3-gsm8k-worker-0-0.qwen3-gsm8k:8476"
    assert env["JOB_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['jobset.sigs.k8s.io/job-index']"
    assert "JAX_PLATFORMS" not in env and "initContainers" not in pod
    jobs, pods = rjob["replicas"], rjob["template"]["spec"]["completions"]
    assert env["JAX_NUM_PROCESSES"]["value"] == str(jobs * pods)
    ids = [_process_id(trainer, job, index) for job in range(jobs) for index in range(pods)]
    assert ids == list(range(jobs * pods))  # every process gets a distinct id, 0 on the coordinator
    if backend == "mcjax":
        assert (jobs, pods) == (2, 4)  # one Job per slice, one pod per v6e VM
        assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4"
        assert trainer["resources"]["limits"] == {"google.com/tpu": "4"}
        assert env["MEGASCALE_COORDINATOR_ADDRESS"]["value"] == "qwen3-gsm8k-worker-0-0.qwen3-gsm8k"
    else:
        assert (jobs, pods) == (1, GPU["nodes"])
        assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": GPU["accelerator"]}
        assert trainer["resources"]["limits"] == {"nvidia.com/gpu": str(GPU["gpusPerNode"])}


@pytest.mark.parametrize("phase", ["convert", "export"])
def test_convert_and_export_are_single_cpu_pods(phase):
    spec = spec_dict(compute={**compute("pathways"), "cpuNodePool": "big-cpu"})
    jobset = _rendered(lorajob(spec=spec))[phase]
    (rjob,) = jobset["spec"]["replicatedJobs"]
    assert rjob["replicas"] == 1 and rjob["template"]["spec"]["parallelism"] == 1
    pod = rjob["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-nodepool": "big-cpu"}
    assert "tolerations" not in pod and "google.com/tpu" not in repr(pod)
    assert _commands(pod["containers"][0])[-1][2] == f"lorajob_trainer.{phase}"


def test_train_arguments_parse_back_into_the_trainer_config():
    spec = spec_dict(
        lora={"rank": 8, "alpha": 16, "targetModules": ".*q_proj", "restoreFrom": {"checkpoint": "gs://b/old/lora"}},
        training={"steps": 7, "learningRate": 1e-4, "schedule": "linear", "checkpointPeriod": 3},
        dataset={"name": "openai/gsm8k", "dataDir": "main", "columns": ["question", "answer"], "evalSplit": "test"},
    )
    trainer = _pod_templates(_rendered(lorajob(spec=spec))["train"])["pathways-head"]["spec"]["containers"][0]
    config = TrainConfig.from_args(trainer["command"][3:])
    assert config == step_commands.train_config(parsed(lorajob(spec=spec)), "qwen3-gsm8k")
    assert (config.steps, config.learning_rate, config.lr_schedule, config.checkpoint_period) == (7, 1e-4, "linear", 3)
    assert (config.lora.lora_rank, config.lora.lora_alpha, config.lora.lora_module_path) == (8, 16.0, ".*q_proj")
    assert config.lora.lora_restore_path == "gs://b/old/lora"
    assert config.load_parameters_path == "gs://bucket/runs/qwen3-gsm8k/base"  # the convert step's output
    assert (config.hf_path, config.hf_data_dir, config.train_data_columns) == ("openai/gsm8k", "main", ["question", "answer"])
    assert (config.hf_eval_split, config.eval_interval) == ("test", 3)
    assert config.checkpoint_storage_use_zarr3 is False and config.checkpoint_storage_use_ocdbt is False


def test_images_come_from_the_spec_then_the_operator_settings():
    settings = RenderSettings(images=Images(trainer="registry/trainer:1", pathways_server="registry/server:1"))
    spec = spec_dict(images={"pathwaysProxy": "registry/proxy:2"})
    templates = _pod_templates(_rendered(lorajob(spec=spec), settings)["train"])
    head = templates["pathways-head"]["spec"]
    assert head["containers"][0]["image"] == "registry/trainer:1"
    assert {c["name"]: c["image"] for c in head["initContainers"]} == {"pathways-rm": "registry/server:1", "pathways-proxy": "registry/proxy:2"}
    assert templates["worker"]["spec"]["containers"][0]["image"] == "registry/server:1"


def test_a_retry_is_labelled_with_its_attempt_and_keeps_the_name():
    body = lorajob()
    retry = jobsets.render_phase("train", parsed(body), owner(body), SETTINGS, attempt=2)
    assert retry["metadata"]["name"] == "qwen3-gsm8k"
    assert retry["metadata"]["labels"][names.LABEL_ATTEMPT] == "2"


def test_a_spec_the_crd_would_reject_is_reported_not_rendered():
    body = lorajob("a" * 23)  # too long for pathways + convert/export
    spec, errors = validation.parse_spec(body)
    assert spec is None and "at most 20" in errors[0]
    spec, errors = validation.parse_spec(lorajob(spec=spec_dict(training={"steps": 0})))
    assert spec is None and errors[0].startswith("spec.training.steps")


def _commands(container: dict) -> list[list[str]]:
    """The entry-point argument lists of a container (a `sh -c 'a && b'` chain split up)."""
    command = container["command"]
    if command[:2] == ["/bin/sh", "-c"]:
        return [shlex.split(part) for part in command[2].split(" && ")]
    return [command]


def test_convert_and_export_arguments_are_accepted_by_the_trainer_entry_points(monkeypatch):
    convert = pytest.importorskip("lorajob_trainer.convert", reason="needs the trainer extra (JAX)")
    export = pytest.importorskip("lorajob_trainer.export", reason="needs the trainer extra (JAX)")
    datacheck = pytest.importorskip("lorajob_trainer.datacheck", reason="needs the trainer extra (JAX)")
    from lorajob_trainer import fit
    from lorajob_trainer.contract.fit import Attempt, Plan

    calls = []
    monkeypatch.setattr(datacheck, "check", lambda config, devices: calls.append(("check", (config.hf_path, devices), {}))
                        or datacheck.DataReport(1, 10, 5, 0, 0, 1, 1))
    monkeypatch.setattr(fit, "check", lambda config, model_config, request: calls.append(
        ("fit", (model_config, request.targets[0].chips, config.per_device_batch_size), {}))
        or Plan(Attempt(
            request.targets[0], fits=True, capacity_bytes=2, total_bytes=1, flops_per_step=1.0,
            executed_flops_per_step=1.5, step_seconds=1.0, tokens_per_second_per_chip=1.0, mfu=0.5, bound="compute",
            compile_seconds=1.0,
            memory=dict.fromkeys(("arguments", "temporaries", "outputs_not_aliased", "base_weights",
                                  "adapters_and_optimizer", "batch"), 0),
        ), []))
    monkeypatch.setattr(convert, "convert_base", lambda *a, **k: calls.append(("base", a, k)))
    monkeypatch.setattr(convert, "convert_adapter", lambda *a, **k: calls.append(("adapter", a, k)))
    monkeypatch.setattr(export, "export_adapter", lambda *a, **k: calls.append(("export", a, k)))
    monkeypatch.setattr(export, "export_merged", lambda *a, **k: calls.append(("merged", a, k)))
    spec = spec_dict(
        lora={"restoreFrom": {"huggingFace": "/data/old-adapter"}}, export={"merged": True},
        output={"baseOutputDirectory": "/runs"},
    )
    jobsets = _rendered(lorajob(spec=spec))
    for phase, modules in (("convert", (datacheck, fit, convert, convert)), ("export", (export,))):
        (container,) = _pod_templates(jobsets[phase])[phase]["spec"]["containers"]
        for command, module in zip(_commands(container), modules, strict=True):
            assert command[:3] == ["python", "-m", module.__name__]
            assert module.main(command[3:]) in (None, 0)
    assert [call[0] for call in calls] == ["check", "fit", "base", "adapter", "export", "merged"]
    assert calls[0][1] == ("openai/gsm8k", 16)  # the dataset the train step reads; 16 chips of a 4x4 v6e slice
    assert calls[1][1] == ("Qwen/Qwen3-0.6B", 16, 1)  # the model's config.json, the train step's chips and batch
    base, adapter, exported = (tuple(map(str, call[1])) for call in calls[2:5])
    assert base == ("qwen3-0.6b", "Qwen/Qwen3-0.6B", "/runs/qwen3-gsm8k/base")
    assert adapter == ("qwen3-0.6b", "/runs/qwen3-gsm8k/base", "/data/old-adapter", "/runs/qwen3-gsm8k/restore-adapter")
    assert exported == ("/runs/qwen3-gsm8k/checkpoints", "/runs/qwen3-gsm8k/huggingface")


def test_the_fit_check_tries_the_cheapest_changes_first():
    spec = parsed(lorajob(spec=spec_dict(training={"steps": 10, "perDeviceBatchSize": 4})))
    request = step_commands.plan_request(spec)
    # remat auto (the default) at the LoRAJob's own target; an alternative asks only whether it fits: remat full.
    assert [(t.topology, t.per_device_batch_size, t.gradient_accumulation_steps, t.remat_policy) for t in request.targets] == [
        ("4x4", 4, 1, "auto"), ("4x4", 2, 2, "full"), ("4x4", 1, 4, "full"), ("4x8", 4, 1, "full"), ("8x8", 4, 1, "full"),
    ]
    assert request.chip.hbm_bytes == 32 * 2**30 and [t.chips for t in request.targets][-1] == 64
    minimal = step_commands.plan_request(parsed(lorajob(spec=spec_dict(training={"steps": 10, "remat": "minimal"}))))
    assert [t.remat_policy for t in minimal.targets][:2] == ["minimal", "full"]
    assert step_commands.plan_request(parsed(lorajob(spec=spec_dict(training={"steps": 10, "remat": "full"})))).targets[1].remat_policy == "full"


@pytest.mark.parametrize(("field", "option"), [("rsLoRA", "use_rslora"), ("dora", "use_dora")])
def test_lora_variants_reach_the_trainer(field, option):
    spec = parsed(lorajob(spec=spec_dict(lora={"rank": 64, "alpha": 16, field: True})))
    assert getattr(step_commands.train_config(spec, "r").lora, option)
    assert f"lora.{option}=true" in step_commands.train_command(spec, "r", owner(lorajob()))
    assert not getattr(step_commands.train_config(parsed(lorajob()), "r").lora, option)


def test_base_quantization_reaches_the_trainer():
    spec = parsed(lorajob(spec=spec_dict(lora={"baseQuantization": "nf4"})))
    assert step_commands.train_config(spec, "r").lora.base_quantization == "nf4"
    assert step_commands.train_config(parsed(lorajob()), "r").lora.base_quantization == "none"


def test_packing_and_the_seed_reach_the_trainer():
    config = step_commands.train_config(parsed(lorajob(spec=spec_dict(training={"steps": 10, "packing": False, "seed": 7}))), "r")
    assert (config.packing, config.seed, config.data_shuffle_seed) == (False, 7, 7)
    default = step_commands.train_config(parsed(lorajob()), "r")
    assert (default.packing, default.seed, default.data_shuffle_seed) == (True, 0, 0)


def test_eval_interval_is_its_own_setting_and_defaults_to_the_checkpoint_period():
    dataset = {"name": "openai/gsm8k", "dataDir": "main", "columns": ["question", "answer"], "evalSplit": "test"}
    own = parsed(lorajob(spec=spec_dict(dataset=dataset, training={"steps": 20, "checkpointPeriod": 10, "evalInterval": 4})))
    assert step_commands.train_config(own, "r").eval_interval == 4
    default = parsed(lorajob(spec=spec_dict(dataset=dataset, training={"steps": 20, "checkpointPeriod": 10})))
    assert step_commands.train_config(default, "r").eval_interval == 10
    assert step_commands.train_config(parsed(lorajob()), "r").eval_interval == 0  # no evalSplit: no evaluation


def test_evaluation_reaches_the_trainer_and_the_export_gate_the_export_step():
    dataset = {"name": "openai/gsm8k", "dataDir": "main", "columns": ["question", "answer"], "evalSplit": "test"}
    spec = parsed(lorajob(spec=spec_dict(
        dataset=dataset, evaluation={"scorer": "gsm8k", "maxNewTokens": 300, "examples": 100},
        export={"requireImprovement": True, "minimumStopRate": 0.95}, output={"baseOutputDirectory": "/runs"},
    )))
    settings = step_commands.train_config(spec, "r").generation_eval
    assert (settings.enabled, settings.scorer, settings.max_new_tokens, settings.examples, settings.samples) == (
        True, "gsm8k", 300, 100, 3)
    command = step_commands.export_command(spec, "r", owner(lorajob()))
    gate = command[command.index("--evaluation"):]
    assert gate == ["--evaluation", "/runs/r/evaluation.json", "--require-improvement", "--minimum-stop-rate", "0.95"]
    assert not step_commands.train_config(parsed(lorajob()), "r").generation_eval.enabled
    assert "--evaluation" not in step_commands.export_command(parsed(lorajob()), "r", owner(lorajob()))


@pytest.mark.parametrize("backend", ["mcjax", "gpu"])
def test_the_train_step_keeps_compiled_programs_beside_the_runs_or_where_the_spec_says(backend):
    default = parsed(lorajob(spec=spec_dict(compute=compute(backend))))
    assert step_commands.train_config(default, "r").compilation_cache_dir == "gs://bucket/runs/_compilation-cache"
    own = parsed(lorajob(spec=spec_dict(compute=compute(backend), output={
        "baseOutputDirectory": "gs://bucket/runs", "compilationCache": "gs://shared/jax-cache"})))
    assert step_commands.train_config(own, "r").compilation_cache_dir == "gs://shared/jax-cache"


def test_a_pathways_train_step_leaves_compiling_to_the_pathways_server():
    spec = parsed(lorajob(spec=spec_dict(compute=compute("pathways"))))
    assert step_commands.train_config(spec, "r").compilation_cache_dir == ""


PREFERENCE_DATASET = {"name": "trl-lib/ultrafeedback_binarized", "columns": ["chosen", "rejected"], "evalSplit": "test"}


def test_a_preference_method_and_its_settings_reach_the_train_step_and_both_checks():
    """method and preference.* become the trainer's keys on the train command line, and the data check and the fit
    check (the convert step's chain) get the same config: the fit check compiles the preference step."""
    spec = spec_dict(dataset=PREFERENCE_DATASET, method="dpo",
                     preference={"beta": 0.25, "lossType": "robust", "labelSmoothing": 0.1})
    body = lorajob(spec=spec)
    rendered = _rendered(body)
    train = _commands(_pod_templates(rendered["train"])["pathways-head"]["spec"]["containers"][0])[0]
    keys = ["method=dpo", "preference.beta=0.25", "preference.loss_type=robust", "preference.label_smoothing=0.1"]
    assert all(key in train for key in keys), train
    assert "train_data_columns=[chosen, rejected]" in train
    checks = _commands(_pod_templates(rendered["convert"])["convert"]["spec"]["containers"][0])
    assert [command[2] for command in checks[:2]] == ["lorajob_trainer.datacheck", step_commands.FIT_CHECK]
    for command in checks[:2]:
        assert all(key in command for key in keys), command
    config = TrainConfig.from_args(train[3:])
    assert (config.method, config.preference.beta, config.preference.loss_type) == ("dpo", 0.25, "robust")
    assert config.rows_per_device == 2  # one pair per device: its chosen and its rejected row


def test_orpo_takes_its_lambda_and_unset_preference_settings_the_trainers_defaults():
    orpo = parsed(lorajob(spec=spec_dict(dataset=PREFERENCE_DATASET, method="orpo", preference={"orpoLambda": 0.5})))
    command = step_commands.train_command(orpo, "r", owner(lorajob()))
    assert "method=orpo" in command and "preference.orpo_lambda=0.5" in command
    assert not any(arg.startswith("preference.beta=") for arg in command)
    dpo = step_commands.train_config(parsed(lorajob(spec=spec_dict(dataset=PREFERENCE_DATASET, method="dpo"))), "r")
    assert dpo.method == "dpo" and dpo.preference == TrainConfig.model_fields["preference"].default
    sft = step_commands.train_command(parsed(lorajob()), "r", owner(lorajob()))
    assert not any(arg.startswith(("method=", "preference.")) for arg in sft)  # sft is the trainer's default


TRACKED = {"mlflow": {"trackingUri": "https://mlflow.example.com", "tags": {"team": "a"}},
           "wandb": {"project": "gsm8k", "mode": "offline", "tags": ["lora"]}}


def test_the_train_step_reports_to_the_trackers_as_its_lorajob():
    body = lorajob(spec=spec_dict(tracking=TRACKED))
    train = _commands(_pod_templates(_rendered(body)["train"])["pathways-head"]["spec"]["containers"][0])[0]
    tracking = TrainConfig.from_args(train[3:]).tracking
    assert (tracking.mlflow_tracking_uri, tracking.mlflow_tags) == ("https://mlflow.example.com", {"team": "a"})
    # Unset experiment and run name: the LoRAJob's namespace and name.
    assert (tracking.mlflow_experiment, tracking.mlflow_run_name) == (NAMESPACE, "qwen3-gsm8k")
    assert (tracking.wandb_project, tracking.wandb_entity, tracking.wandb_mode, tracking.wandb_tags) == (
        "gsm8k", "", "offline", ["lora"])
    assert tracking.wandb_dir == ""  # the trainer's choice: under the run directory where it is local
    assert (tracking.job_name, tracking.job_namespace, tracking.job_uid) == ("qwen3-gsm8k", NAMESPACE, UID)


def test_set_experiment_and_run_name_are_kept_and_without_trackers_nothing_is_rendered():
    mlflow = {"trackingUri": "http://mlflow:5000", "experiment": "shared", "runName": "try-3"}
    tracking = step_commands.tracking_config(parsed(lorajob(spec=spec_dict(tracking={"mlflow": mlflow}))), owner(lorajob()))
    assert (tracking.trackers, tracking.mlflow_experiment, tracking.mlflow_run_name) == (("mlflow",), "shared", "try-3")
    plain = parsed(lorajob())
    assert not any(arg.startswith("tracking.") for arg in step_commands.train_command(plain, "r", owner(lorajob())))
    assert "--tracking-record" not in step_commands.export_command(plain, "r", owner(lorajob()))


def test_the_checks_report_to_no_tracker_and_the_export_logs_to_the_train_step_s_runs():
    body = lorajob(spec=spec_dict(tracking=TRACKED))
    rendered = _rendered(body)
    checks = _commands(_pod_templates(rendered["convert"])["convert"]["spec"]["containers"][0])
    assert not any(arg.startswith("tracking.") for command in checks for arg in command)
    (export,) = _commands(_pod_templates(rendered["export"])["export"]["spec"]["containers"][0])
    record = export[export.index("--tracking-record") + 1]
    assert record == "gs://bucket/runs/qwen3-gsm8k/tracking.json"
    # What the export entry point parses back (contract.config.TrackingConfig.from_args) is the train step's section.
    tracking = TrackingConfig.from_args(export[export.index("--tracking-record") + 2:])
    assert tracking == TrainConfig.from_args(_commands(
        _pod_templates(rendered["train"])["pathways-head"]["spec"]["containers"][0])[0][3:]).tracking
    assert tracking.trackers == ("mlflow", "wandb")


TRACKER_CREDENTIALS = {
    "mlflowToken": {"name": "mlflow"}, "wandbApiKey": {"name": "wandb", "key": "api-key"},
}
BASIC_AUTH = {"mlflowUsername": {"name": "mlflow-basic", "key": "user"}, "mlflowPassword": {"name": "mlflow-basic"}}


@pytest.mark.parametrize("credentials, expected", [
    (TRACKER_CREDENTIALS, {"MLFLOW_TRACKING_TOKEN": ("mlflow", "MLFLOW_TRACKING_TOKEN"), "WANDB_API_KEY": ("wandb", "api-key")}),
    (BASIC_AUTH, {"MLFLOW_TRACKING_USERNAME": ("mlflow-basic", "user"),
                  "MLFLOW_TRACKING_PASSWORD": ("mlflow-basic", "MLFLOW_TRACKING_PASSWORD")}),
], ids=["token-and-wandb", "basic-auth"])
def test_tracker_credentials_only_travel_as_secret_key_references_to_every_trainer_container(credentials, expected):
    """Every step's trainer gets them: the first CPU step checks they arrived (as it does the Hugging Face token)."""
    body = lorajob(spec=spec_dict(credentials=credentials, tracking=TRACKED))
    for jobset in _rendered(body).values():
        for template in _pod_templates(jobset).values():
            for container in template["spec"]["containers"] + template["spec"].get("initContainers", []):
                env = _env(container)
                for variable, (secret, key) in expected.items():
                    if container["name"] != names.TRAINER_CONTAINER:
                        assert variable not in env
                        continue
                    assert env[variable] == {
                        "name": variable, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}
                    source = f"LORAJOB_{variable}_SECRET"
                    assert env[source] == {"name": source, "value": f"{secret}/{key}"}


def test_the_export_entry_point_takes_the_tracking_it_is_rendered_with(monkeypatch):
    export = pytest.importorskip("lorajob_trainer.export", reason="needs the trainer extra (JAX)")
    seen = {}
    monkeypatch.setattr(export.tracking.Trackers, "for_export",
                        lambda settings, record: seen.update(settings=settings, record=record))  # None: no runs kept
    monkeypatch.setattr(export, "export", lambda *a, **k: None)
    body = lorajob(spec=spec_dict(tracking=TRACKED))
    (command,) = _commands(_pod_templates(_rendered(body)["export"])["export"]["spec"]["containers"][0])
    export.main(command[3:])
    assert seen["settings"] == step_commands.tracking_config(parsed(body), owner(body))
    assert seen["record"] == "gs://bucket/runs/qwen3-gsm8k/tracking.json"
