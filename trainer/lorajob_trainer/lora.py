"""LoRA with Qwix on Tunix models, target modules per family, and the HF PEFT <-> trainer mapping.

LoRA parameters as a flat dict
    `get_lora_params(model)` returns {NNX path: array} with paths such as
    `layers.0.attn.q_proj.w_lora_a` (Qwix names adapters `<weight>_lora_a` / `<weight>_lora_b`);
    `set_lora_params(model, params)` writes such a dict back (same keys and shapes required).
    Shapes follow Qwix: for an einsum weight, A is [contracting dims..., r] and B is
    [r, remaining dims...] (q_proj: A [D, r], B [r, N, H]; o_proj: A [N, H, r], B [r, D]); for
    nnx.Linear, A [in, r], B [r, out]. The update is x·A·B·scale, scale = alpha/r, or alpha/√r with
    rsLoRA (`scale`), as in PEFT. With DoRA each adapted weight also has `<weight>_lora_magnitude`, shaped
    like its output axes (q_proj [N, H], o_proj [D]; PEFT's lora_magnitude_vector [out] row-major).

Trainer LoRA checkpoint layout (Orbax; checkpoint.py writes it during training, convert.py writes
a single step from an HF PEFT adapter, export.py reads it):

    <root>/<step>/lora/                   Orbax PyTree item: the flat dict above
                                          ({"layers.0.attn.q_proj.w_lora_a": A, ...});
                                          `load_adapter_checkpoint` also accepts it nested on "."
    <root>/<step>/optimizer/, data/       training runs only (checkpoint.py)
    <root>/<step>/_CHECKPOINT_METADATA    custom metadata = checkpoint.CheckpointMetadata:
                                          step, lora_rank, lora_alpha, use_rslora, use_dora,
                                          target_modules (HF names), lora_module_path, base_model,
                                          family, load_parameters_path

HF PEFT adapter: `base_model.model.model.layers.<i>.<hf module>.lora_A.weight` [r, in] and
`lora_B.weight` [out, r], where `lora_A = A.reshape(-1, r).T` and `lora_B = B.reshape(r, -1).T`
(row-major flattening of heads x head_dim matches HF's projection layout). Every HF projection
has its own Tunix module and adapter (Gemma 3's fused key/value einsum is split by
models/kv_split.py), so k_proj and v_proj get independent A and B, as in PEFT.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import qwix
import yaml
from flax import nnx
from flax.nnx import initializers
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from qwix._src.core import qarray  # how Qwix's own providers quantise a weight and find adapted ones
from qwix._src.providers import ptq
from qwix._src.utils import flax_util

from lorajob_trainer import weights
from lorajob_trainer.checkpoint import CheckpointMetadata
from lorajob_trainer.mesh import variable_sharding
from lorajob_trainer.remat import PROJECTION_OUTPUTS
from lorajob_trainer.models import experts, tracing_rngs

PEFT_PREFIX = "base_model.model.model.layers"


class LoraError(ValueError):
    """Bad LoRA targets, shapes or adapter files."""


# --- target modules ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TargetModule:
    name: str
    """HF projection name, e.g. q_proj."""
    hf_path: str
    """Path inside an HF decoder layer, e.g. self_attn.q_proj."""
    tunix_path: str
    """NNX module path inside a Tunix decoder layer, e.g. attn.q_proj."""
    parameter: str | None = None
    """For routed experts: the HF parameter of `hf_path` adapted (PEFT `target_parameters`, see models/experts.py)."""


@functools.cache
def _targets_table() -> dict[str, Any]:
    return yaml.safe_load(resources.files("lorajob_trainer").joinpath("lora_targets.yaml").read_text())


def _family_table(family: str) -> dict[str, Any]:
    table = _targets_table()
    if family not in table:
        raise LoraError(f"no LoRA targets for family {family!r}; families: {', '.join(table)}")
    return table[family]


def default_targets(family: str) -> list[str]:
    """The HF projection names adapted by default (attention q/k/v/o and MLP gate/up/down)."""
    return list(_family_table(family)["default"])


def target_modules_all(family: str) -> list[TargetModule]:
    """Every projection LoRA can adapt in `family`, in lora_targets.yaml order."""
    return [
        TargetModule(name, spec["hf"], spec["tunix"], spec.get("parameter"))
        for name, spec in _family_table(family)["modules"].items()
    ]


def target_modules(family: str, names: list[str] | None = None) -> list[TargetModule]:
    """TargetModules for HF projection `names` (default: the family default) in lora_targets.yaml order;
    LoraError if unknown."""
    known = {t.name: t for t in target_modules_all(family)}
    names = default_targets(family) if names is None else names
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise LoraError(f"unknown target modules {unknown} for {family}; known: {', '.join(known)}")
    return [target for name, target in known.items() if name in names]


def module_path_regex(family: str, names: list[str] | None = None) -> str:
    """The Qwix `module_path` regex (full match on `/`-joined paths) selecting `names`."""
    paths = sorted({t.tunix_path.replace(".", "/") for t in target_modules(family, names)})
    return r"layers/\d+/(" + "|".join(re.escape(p) for p in paths) + ")"


def target_regex(family: str, names: list[str] | None, lora_module_path: str = "") -> str:
    """The Qwix regex a run's adapters use: its explicit `lora_module_path`, else the one selecting `names`
    (train, convert and export all resolve it here)."""
    return lora_module_path or module_path_regex(family, names)


def names_for_regex(family: str, regex: str, num_layers: int) -> list[str]:
    """HF projection names whose Tunix modules `regex` selects in every layer (for adapter_config.json)."""
    pattern = re.compile(regex)
    return [
        t.name
        for t in target_modules_all(family)
        if all(pattern.fullmatch(f"layers/{i}/{t.tunix_path.replace('.', '/')}") for i in range(num_layers))
    ]


# --- applying LoRA -----------------------------------------------------------------------------


def scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """What an adapter's A·B is multiplied by: alpha/r, or with rsLoRA alpha/√r (PEFT's use_rslora)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


MAGNITUDE = "_lora_magnitude"
"""Suffix of a DoRA magnitude (`<weight>_lora_magnitude`, one value per output feature of the weight)."""
CONTRACTING = "_dora_contracting"
"""Suffix of the module attribute naming the weight's input (contracting) axes, which DoRA's norm sums over."""


def _wide(dtype) -> jnp.dtype:
    """float32, or the wider `dtype`: what DoRA's norms and factors are computed in."""
    return jnp.promote_types(dtype, jnp.float32)


def weight_norm(weight: jax.Array, contracting: tuple[int, ...]) -> jax.Array:
    """The norm of each output feature's column of `weight` (over its input axes `contracting`), in at least float32."""
    return jnp.sqrt(jnp.sum(jnp.square(weight.astype(_wide(weight.dtype))), axis=contracting))


class LoraProvider(qwix.LoraProvider):
    """Qwix's LoRA, naming each projection's output (`remat.PROJECTION_OUTPUTS`, the adapter's contribution
    added) for the remat policies: without the name, remat "minimal" (keep every matmul's output) kept the base
    matmul's and the adapter's outputs apart, twice the activations of one projection."""

    def einsum(self, einsum_str: str, *operands, **kwargs) -> jax.Array:
        return self._named(super().einsum(einsum_str, *operands, **kwargs), operands[1])

    def dot_general(self, lhs, rhs, *args, **kwargs) -> jax.Array:
        return self._named(super().dot_general(lhs, rhs, *args, **kwargs), rhs)

    @staticmethod
    def _named(result: jax.Array, rhs) -> jax.Array:
        if flax_util.find_param(rhs, ptq.WithAux) is None:  # no weight: attention's own products, say
            return result
        return checkpoint_name(result, PROJECTION_OUTPUTS)


class DoraProvider(LoraProvider):
    """Qwix's LoRA, with DoRA's decomposition on top (PEFT's use_dora): each adapted weight W gets a learned
    magnitude m (one per output feature, initially the norms of W's columns), and the layer computes
    (m / ‖W + s·A·B‖) ⊙ (x·W + s·x·A·B), the norm taken per output feature and held constant in the backward
    pass (as PEFT does, section 4.3 of the DoRA paper)."""

    def einsum(self, einsum_str: str, *operands, **kwargs) -> jax.Array:
        result = super().einsum(einsum_str, *operands, **kwargs)
        rule, name = self._adapted_weight(operands[1], "einsum")
        if name is None:
            return result
        module = flax_util.get_current_module()
        inputs, output = einsum_str.replace(" ", "").split("->")
        lhs, rhs = inputs.split(",")
        _, a_str, b_str = getattr(module, name + "_lora_einsum_str").split("->")[0].split(",")
        contracting = tuple(i for i, c in enumerate(rhs) if c in lhs)
        delta = jnp.einsum(f"{a_str},{b_str}->{rhs}", getattr(module, name + "_lora_a").get_value(),
                           getattr(module, name + "_lora_b").get_value())
        factor = self._factor(module, name, operands[1], delta * (rule.alpha / rule.rank), contracting)
        remaining = "".join(c for c in rhs if c not in lhs)
        return jnp.einsum(f"{output},{remaining}->{output}", result, factor.astype(result.dtype))

    def dot_general(self, lhs, rhs, dimension_numbers, *args, **kwargs) -> jax.Array:
        result = super().dot_general(lhs, rhs, dimension_numbers, *args, **kwargs)
        rule, name = self._adapted_weight(rhs, "dot_general")
        if name is None:
            return result
        (_, contracting), (_, batch) = dimension_numbers
        if batch:
            raise LoraError("DoRA does not support batched matmuls (routed experts); target other modules")
        module = flax_util.get_current_module()
        remaining = tuple(i for i in range(rhs.ndim) if i not in contracting)
        shape = tuple(rhs.shape[i] for i in (*contracting, *remaining))
        delta = (getattr(module, name + "_lora_a").get_value() @ getattr(module, name + "_lora_b").get_value()).reshape(shape)
        delta = jnp.transpose(delta, np.argsort((*contracting, *remaining)))
        scaled = delta * (rule.alpha / rule.rank)
        # The remaining axes of the weight are the result's last ones, in order: the factor broadcasts.
        return result * self._factor(module, name, rhs, scaled, tuple(contracting)).astype(result.dtype)

    def _adapted_weight(self, rhs, op: str) -> tuple[Any, str | None]:
        """The LoRA rule of this op and the name of the weight it adapts (None: no rule here, or `rhs` is no weight)."""
        rule, _ = self._get_current_rule_and_op_id(op, repeated_call=True)
        return rule, flax_util.find_param(rhs, ptq.WithAux) if isinstance(rule, qwix.LoraRule) else None

    @staticmethod
    def _factor(module: nnx.Module, name: str, weight: jax.Array, scaled_delta: jax.Array,
                contracting: tuple[int, ...]) -> jax.Array:
        """m / ‖W + s·A·B‖ per output feature; the magnitude is made (‖W‖) on first use."""
        if not hasattr(module, name + CONTRACTING):
            setattr(module, name + CONTRACTING, contracting)
        magnitude = flax_util.get_or_create_param(
            name + MAGNITUDE, lambda: weight_norm(weight, contracting).astype(weight.dtype), nnx_param_type=nnx.LoRAParam)
        wide = _wide(weight.dtype)
        adapted = weight.astype(wide) + scaled_delta.astype(wide)
        return magnitude.astype(wide) / jax.lax.stop_gradient(weight_norm(adapted, contracting))


class QuantizedBaseLoraProvider(LoraProvider):
    """Qwix's (Q)LoRA, also letting a quantised weight through `jnp.astype`: Tunix's projections cast their
    weight to the compute dtype that way (Qwix intercepts `jnp.asarray`, not `jnp.astype`), which for a
    quantised weight casts its scale and keeps it quantised."""

    def astype(self, x, dtype, *args, **kwargs):
        if isinstance(x, (ptq.WithAux, qarray.QArray)):
            return self.asarray(x, dtype=dtype)
        return jnp.astype(x, dtype, *args, **kwargs)

    def get_intercept_map(self):
        return super().get_intercept_map() | {"jax.numpy.astype": self.astype}


QUANTIZED_TYPES: dict[str, Any] = {"int8": jnp.int8, "int4": jnp.int4, "nf4": "nf4", "fp8": jnp.float8_e4m3fn}
"""contract.records.BASE_QUANTIZATIONS (but none) -> Qwix's weight qtype."""
DECODER_LAYERS = "layers/.*"
"""Module paths of the decoder layers: what QLoRA quantises (the embedding, read by index, stays as loaded)."""
NOT_ROUTERS = "(?!.*/router$)"
"""Nor the MoE routers: a few MB, and the top-k choice of experts is the most rounding-sensitive part of the layer."""


def apply_lora(
    model: nnx.Module, *, rank: int, alpha: float, target_regex: str, mesh: Mesh, rngs: nnx.Rngs,
    rslora: bool = False, dora: bool = False, base_quantization: str = "none",
) -> nnx.Module:
    """A copy of `model` with LoRA adapters (nnx.LoRAParam, A random, B zero) on matching modules, with
    `dora` a DoRA magnitude per adapted weight (DoraProvider), and with a `base_quantization` (QLoRA) every
    decoder projection but the MoE routers held quantised per output channel (Qwix's PTQ; the routed experts
    by `ExpertsLinear.quantize`).

    `target_regex` is matched in full against `/`-joined module paths (`layers/0/attn/q_proj`);
    see `module_path_regex`. Adapters take the sharding of their base weight over `mesh`.
    LoraError when the regex selects nothing (training would otherwise silently do nothing).
    """
    if rank <= 0:
        raise LoraError(f"LoRA rank must be positive, got {rank}")
    expert_paths = ["/".join(map(str, p)) for p, m in nnx.iter_graph(model) if isinstance(m, experts.ExpertsLinear)]
    if dora and any(re.fullmatch(target_regex, path) for path in expert_paths):
        raise LoraError("DoRA is supported on attention and dense MLP projections, not on routed experts: "
                        "leave the experts out of the targets, or train them without DoRA")
    # Routed experts carry their own adapters; Qwix must not also adapt the matmuls inside them.
    qwix_regex = "".join(f"(?!{re.escape(p)}$)" for p in expert_paths) + f"(?:{target_regex})"
    # Qwix and the experts scale by alpha/rank: the alpha that gives `scale`.
    alpha = scale(alpha, rank, rslora) * rank
    qtype = QUANTIZED_TYPES.get(base_quantization)
    rules = [qwix.LoraRule(module_path=qwix_regex, rank=rank, alpha=alpha, weight_qtype=qtype)]
    if qtype is not None:  # the frozen projections that carry no adapter, the first matching rule applying
        not_experts = "".join(f"(?!{re.escape(p)}$)" for p in expert_paths)
        rules.append(qwix.QtRule(module_path=not_experts + NOT_ROUTERS + DECODER_LAYERS, weight_qtype=qtype))
    provider = (DoraProvider if dora else QuantizedBaseLoraProvider if qtype is not None else LoraProvider)(rules)
    batch = mesh.devices.size
    inputs = (jnp.zeros((batch, 1), jnp.int32), jnp.zeros((batch, 1), jnp.int32), None, jnp.ones((batch, 1, 1), bool))
    graphdef, base = nnx.split(model)

    def adapted(base: nnx.State) -> nnx.Module:
        with mesh:  # not jax.set_mesh: this also runs under jit (abstract model building)
            return qwix.apply_lora_to_model(nnx.merge(graphdef, base), provider, *inputs, rngs=tracing_rngs())

    # Qwix finds the modules to adapt by running the model once. It runs abstractly: eagerly, every op on arrays
    # that span the processes of a multi-host run is a computation all of them must join, and two processes
    # came to join them in different orders (a deadlock). The adapters are then made by jitted initialisers.
    lora_model = nnx.eval_shape(adapted, base)
    _fill(lora_model, base, mesh, rngs)
    for path, module in nnx.iter_graph(lora_model):
        if isinstance(module, experts.ExpertsLinear) and re.fullmatch(target_regex, "/".join(map(str, path))):
            module.add_lora(rank, alpha, rngs)
    if qtype is not None:
        for _, module in nnx.iter_graph(lora_model):
            if isinstance(module, experts.ExpertsLinear):
                module.quantize(qtype, mesh)
    state = nnx.state(lora_model, nnx.LoRAParam)
    flat = nnx.to_flat_state(state)
    if not flat:
        raise LoraError(f"LoRA target regex {target_regex!r} matches no module of the model")
    _check_rank_fits(flat, rank)
    for _, variable in flat:
        variable.set_value(jax.device_put(variable.get_value(), variable_sharding(mesh, variable)))
    nnx.update(lora_model, state)
    return lora_model


def _fill(lora_model: nnx.Module, base: nnx.State, mesh: Mesh, rngs: nnx.Rngs) -> None:
    """Give the abstract `lora_model` the base weights of `base` and new adapters (A He-uniform as Qwix draws it,
    B zero), each made by a jitted initialiser in its sharding over `mesh`, in path order on every process."""
    weights_by_path = dict(nnx.to_flat_state(base))
    state = nnx.state(lora_model)
    # One jitted initialiser per kind, shape, dtype and sharding, which the layers' adapters share: a jit of a new
    # function object compiles anew (0.13 s per adapter on CPU, against 3 ms for a call of a compiled one).
    made: dict[tuple, Callable[[jax.Array], jax.Array]] = {}
    modules = dict(nnx.iter_graph(lora_model))
    quantized = {(*path, name): value for path, module in modules.items() if isinstance(module, nnx.Module)
                 for name, value in vars(module).items() if isinstance(value, ptq.WithAux)}
    done: dict[tuple, Any] = {}
    for path, variable in sorted(nnx.to_flat_state(state), key=lambda item: tuple(map(str, item[0]))):
        if path in weights_by_path:
            variable.set_value(weights_by_path[path].get_value())
            continue
        if path[:-2] in quantized:  # (<weight>, "array", "qvalue" | "scale"): the base weight, quantised in place
            weight = path[:-2]
            if weight not in done:
                done[weight] = _quantizer(quantized[weight], mesh, made)(weights_by_path[weight].get_value())
            variable.set_value(getattr(done[weight], str(path[-1])))
            continue
        value = variable.get_value()
        if str(path[-1]).endswith(MAGNITUDE):  # DoRA starts at the weight's own norms: the model is unchanged
            name = str(path[-1])[: -len(MAGNITUDE)]
            contracting = getattr(modules[path[:-1]], name + CONTRACTING)
            kind = ("magnitude", contracting, value.dtype, variable_sharding(mesh, variable))
            if kind not in made:
                made[kind] = jax.jit(lambda w, axes=contracting, dtype=value.dtype: weight_norm(w, axes).astype(dtype),
                                     out_shardings=kind[-1])
            variable.set_value(made[kind](weights_by_path[(*path[:-1], name)].get_value()))
            continue
        kind = (str(path[-1]).endswith("_lora_a"), value.shape, value.dtype, variable_sharding(mesh, variable))
        if kind not in made:
            is_a, shape, dtype, sharding = kind
            made[kind] = jax.jit(functools.partial(_ADAPTER_INITIALIZERS[is_a], shape=shape, dtype=dtype),
                                 out_shardings=sharding)
        variable.set_value(made[kind](rngs.params()))
    nnx.update(lora_model, state)


def _quantizer(abstract: ptq.WithAux, mesh: Mesh, made: dict) -> Callable[[jax.Array], Any]:
    """A jitted function quantising a base weight as Qwix's `abstract` says, each part (qvalue, scale) made in its
    sharding over `mesh`; one per shape and way, shared by the layers."""
    shardings = jax.tree.map(lambda part: variable_sharding(mesh, part), abstract.array,
                             is_leaf=lambda x: isinstance(x, nnx.Variable))
    kind = ("quantize", tuple(abstract.shape), repr(abstract.how), repr(shardings))
    if kind not in made:
        made[kind] = jax.jit(lambda w: qarray.quantize(w.reshape(abstract.shape), abstract.how), out_shardings=shardings)
    return made[kind]


_ADAPTER_INITIALIZERS = {True: initializers.he_uniform(), False: initializers.zeros}
"""By whether the variable is an A (`..._lora_a`): the initialisers Qwix's LoraRule uses by default."""


def _check_rank_fits(flat: list, rank: int) -> None:
    """LoraError when `rank` exceeds a side of an adapted weight: such an adapter is no longer low-rank
    (it holds more parameters than the weight it adapts and can express no more)."""
    for path, variable in flat:
        if str(path[-1]).endswith(MAGNITUDE):
            continue
        shape = variable.get_value().shape
        side = math.prod(shape[:-1]) if str(path[-1]).endswith("_lora_a") else math.prod(shape[1:])
        if rank > side:
            module = "/".join(str(part) for part in path[:-1])
            raise LoraError(f"lora.lora_rank={rank} does not fit {module}: that weight has a side of {side}")


def get_lora_params(model: nnx.Module) -> dict[str, jax.Array]:
    """{NNX path: array} of every LoRA parameter (see module docstring)."""
    return {weights.path_key(path): v.get_value() for path, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}


def set_lora_params(model: nnx.Module, params: Mapping[str, Any]) -> None:
    """Overwrite the model's LoRA parameters; LoraError unless keys and shapes match exactly.

    Values are placed with the sharding of the parameter they replace.
    """
    state = nnx.state(model, nnx.LoRAParam)
    flat = nnx.to_flat_state(state)
    current = {weights.path_key(path): v for path, v in flat}
    if set(current) != set(params):
        missing, extra = sorted(set(current) - set(params)), sorted(set(params) - set(current))
        raise LoraError(f"LoRA parameters do not match the model: missing {missing[:4]}, unexpected {extra[:4]}")
    for key, variable in current.items():
        value, old = params[key], variable.get_value()
        if tuple(value.shape) != tuple(old.shape):
            raise LoraError(f"LoRA parameter {key} has shape {tuple(value.shape)}, model has {tuple(old.shape)}")
        variable.set_value(jax.device_put(jnp.asarray(value, old.dtype), old.sharding))
    nnx.update(model, state)


# --- HF PEFT mapping ---------------------------------------------------------------------------


def _peft_key(layer: int, target: TargetModule, which: str, targets: list[TargetModule]) -> str:
    """PEFT's tensor name. PEFT nests one ParamWrapper per adapted parameter of a module, in the module's
    parameter order (whatever the order of `target_parameters`), the last outermost: an earlier one sits
    under `base_layer.` once per later one. `targets` are the adapted ones in lora_targets.yaml order,
    which lists a module's parameters in that order."""
    later = [t for t in targets[targets.index(target) + 1 :] if t.parameter and t.hf_path == target.hf_path]
    nesting = "base_layer." * len(later) if target.parameter else ""
    if which == "magnitude":  # DoRA's, one value per output feature
        return f"{PEFT_PREFIX}.{layer}.{target.hf_path}.lora_magnitude_vector"
    return f"{PEFT_PREFIX}.{layer}.{target.hf_path}.{nesting}lora_{which}.weight"


def peft_target_lists(family: str, names: list[str]) -> tuple[list[str], list[str]]:
    """adapter_config.json (target_modules, target_parameters) for our target `names`."""
    targets = target_modules(family, names)
    return [t.name for t in targets if not t.parameter], [t.name for t in targets if t.parameter]


def _our_key(layer: int, target: TargetModule, weight: str, which: str) -> str:
    return f"layers.{layer}.{target.tunix_path}.{weight}_lora_{which}"


def _weight_name(params: Mapping[str, Any], layer: int, target: TargetModule) -> str | None:
    prefix = f"layers.{layer}.{target.tunix_path}."
    names = {k[len(prefix) :].rsplit("_lora_", 1)[0] for k in params if k.startswith(prefix) and "_lora_" in k}
    if len(names) > 1:
        raise LoraError(f"several adapted weights under {prefix}: {sorted(names)}")
    return names.pop() if names else None


def to_peft(
    params: Mapping[str, Any], family: str, num_layers: int, rank: int
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Trainer LoRA params -> (PEFT adapter tensors, target module names found)."""
    tensors: dict[str, np.ndarray] = {}
    used: set[str] = set()
    present = [
        t for t in target_modules_all(family) if any(_weight_name(params, i, t) for i in range(num_layers))
    ]
    for target in present:
        for layer in range(num_layers):
            weight = _weight_name(params, layer, target)
            if weight is None:
                continue
            a_key, b_key = _our_key(layer, target, weight, "a"), _our_key(layer, target, weight, "b")
            a, b = np.asarray(params[a_key]), np.asarray(params[b_key])
            used.update((a_key, b_key))
            if a.shape[-1] != rank or b.shape[-2 if target.parameter else 0] != rank:
                raise LoraError(f"{a_key}/{b_key} have shapes {a.shape}/{b.shape}, metadata says rank {rank}")
            if target.parameter:
                lora_a, lora_b = experts.to_peft(a, b)
            else:
                lora_a, lora_b = a.reshape(-1, rank).T, b.reshape(rank, -1).T
            tensors[_peft_key(layer, target, "A", present)] = np.ascontiguousarray(lora_a)
            tensors[_peft_key(layer, target, "B", present)] = np.ascontiguousarray(lora_b)
            magnitude_key = _our_key(layer, target, weight, "magnitude")
            if magnitude_key in params:  # laid out like B's output side: row-major over the weight's output axes
                tensors[_peft_key(layer, target, "magnitude", present)] = np.asarray(params[magnitude_key]).reshape(-1)
                used.add(magnitude_key)
    found = [t.name for t in present]
    leftover = sorted(set(params) - used)
    if leftover:
        raise LoraError(f"LoRA parameters with no HF PEFT equivalent: {leftover[:4]}")
    return tensors, found


def from_peft(
    tensors: Mapping[str, np.ndarray], targets: list[TargetModule], template: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """PEFT adapter tensors -> trainer LoRA params shaped like `template` (the model's LoRA params).

    `targets` as `target_modules` returns them. LoraError for missing or unexpected tensors, or wrong shapes.
    """
    params: dict[str, np.ndarray] = {}
    used: set[str] = set()
    layers = sorted({int(k.split(".")[1]) for k in template})
    for layer in layers:
        for target in targets:
            weight = _weight_name(template, layer, target)
            if weight is None:  # the layer has no such projection (Gemma 4: k_eq_v and KV-shared layers)
                continue
            a_key, b_key = _our_key(layer, target, weight, "a"), _our_key(layer, target, weight, "b")
            a_shape, b_shape = tuple(template[a_key].shape), tuple(template[b_key].shape)
            a_name, b_name = _peft_key(layer, target, "A", targets), _peft_key(layer, target, "B", targets)
            for name in (a_name, b_name):
                if name not in tensors:
                    raise LoraError(f"adapter lacks {name}")
            used.update((a_name, b_name))
            a, b = np.asarray(tensors[a_name]), np.asarray(tensors[b_name])
            if target.parameter and (a.ndim != 2 or a.shape[0] != math.prod(a_shape[::2])):
                raise LoraError(
                    f"adapter tensor {a_name} has shape {a.shape}, the model's {a_shape[0]} experts of rank "
                    f"{a_shape[-1]} need {a_shape[0] * a_shape[-1]} rows"
                )
            a, b = experts.from_peft(a, b, a_shape[0]) if target.parameter else (a.T, b.T)
            if a.size != math.prod(a_shape) or b.size != math.prod(b_shape):
                raise LoraError(
                    f"adapter tensors for layers.{layer}.{target.tunix_path} have shapes {a.shape}/{b.shape}, "
                    f"model needs {a_shape}/{b_shape} (rank {a_shape[-1]})"
                )
            params[a_key], params[b_key] = a.reshape(a_shape), b.reshape(b_shape)
            magnitude_key = _our_key(layer, target, weight, "magnitude")
            if magnitude_key in template:
                name = _peft_key(layer, target, "magnitude", targets)
                shape = tuple(template[magnitude_key].shape)
                if name not in tensors or np.asarray(tensors[name]).size != math.prod(shape):
                    raise LoraError(f"a DoRA adapter needs {name} with {math.prod(shape)} values (one per output feature)")
                params[magnitude_key] = np.asarray(tensors[name]).reshape(shape)
                used.add(name)
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise LoraError(f"adapter tensors with no place in the model: {unexpected[:4]}")
    return params


# A multimodal checkpoint (Gemma 3 >= 4B, Gemma 4; config.json with a text_config) holds its decoder
# under `model.language_model.`, and PEFT names adapters by that module path. to_peft / from_peft
# use the text-only names; these convert at the boundary.
PEFT_MULTIMODAL_PREFIX = "base_model.model.model.language_model.layers"


def is_multimodal(hf_config: Mapping[str, Any]) -> bool:
    return "text_config" in hf_config


def _rename_prefix(tensors: Mapping[str, Any], old: str, new: str) -> dict[str, Any]:
    return {(new + key[len(old) :] if key.startswith(old + ".") else key): value for key, value in tensors.items()}


def peft_names_for_base(tensors: Mapping[str, Any], hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """to_peft's tensors named as PEFT names them on the base model of `hf_config`."""
    return _rename_prefix(tensors, PEFT_PREFIX, PEFT_MULTIMODAL_PREFIX) if is_multimodal(hf_config) else dict(tensors)


def peft_names_from_base(tensors: Mapping[str, Any], hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `peft_names_for_base`; adapters outside the language model keep their names (and are
    then refused by from_peft as having no place in the model)."""
    return _rename_prefix(tensors, PEFT_MULTIMODAL_PREFIX, PEFT_PREFIX) if is_multimodal(hf_config) else dict(tensors)


def peft_target_modules(names: list[str], hf_config: Mapping[str, Any]) -> list[str] | str:
    """adapter_config.json target_modules for `names`: the list, or for a multimodal base a regex limited to
    the language model, as PEFT's own Gemma 4 default is (the vision tower has modules of the same names,
    which PEFT would otherwise adapt or fail on)."""
    if not is_multimodal(hf_config) or not names:
        return names
    return r".*language_model\.layers\.\d+\..*\.(" + "|".join(re.escape(n) for n in names) + ")"


def names_for_peft_regex(family: str, regex: str, num_layers: int, hf_config: Mapping[str, Any]) -> list[str]:
    """Our target names whose modules PEFT's `target_modules` regex (matched in full against module names,
    as PEFT does) selects in some decoder layer of the base of `hf_config`."""
    decoder = "model.language_model" if is_multimodal(hf_config) else "model"
    pattern = re.compile(regex)
    return [
        t.name
        for t in target_modules_all(family)
        if not t.parameter
        and any(pattern.fullmatch(f"{decoder}.layers.{i}.{t.hf_path}") for i in range(num_layers))
    ]


def merged_base_params(model: nnx.Module, rank: int, lora_scale: float) -> dict[str, np.ndarray]:
    """The model's base params (host arrays) with each adapter folded in: W += (A·B)·lora_scale (`scale`), and
    with DoRA each output feature's column of that rescaled to its magnitude, m·W'/‖W'‖."""
    base = {
        weights.path_key(path): np.asarray(v.get_value())
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
    }
    lora = get_lora_params(model)
    modules = {
        weights.path_key(path): module for path, module in nnx.iter_graph(model) if isinstance(module, nnx.Module)
    }
    for key in (k for k in lora if k.endswith("_lora_a")):
        module_path, weight = key[: -len("_lora_a")].rsplit(".", 1)
        module = modules[module_path]
        a = np.asarray(lora[key], np.float32)
        b = np.asarray(lora[f"{module_path}.{weight}_lora_b"], np.float32)
        if isinstance(module, experts.ExpertsLinear):
            delta = module.lora_delta(a, b) * lora_scale
        else:
            delta = (a.reshape(-1, rank) @ b.reshape(rank, -1) * lora_scale).reshape(*a.shape[:-1], *b.shape[1:])
        einsum_str = getattr(module, "einsum_str", None)
        if einsum_str is not None:
            delta = delta.transpose(_einsum_weight_order(einsum_str))
        w = base[f"{module_path}.{weight}"]
        adapted = w.astype(np.float32) + delta
        magnitude = lora.get(f"{module_path}.{weight}{MAGNITUDE}")
        if magnitude is not None:  # DoRA: each output feature's column rescaled to its learned magnitude
            axes = getattr(module, weight + CONTRACTING)
            norm = np.sqrt(np.sum(np.square(adapted), axis=axes, keepdims=True))
            adapted = np.expand_dims(np.asarray(magnitude, np.float32), axes) / norm * adapted
        base[f"{module_path}.{weight}"] = adapted.astype(w.dtype)
    return base


def _einsum_weight_order(einsum_str: str) -> list[int]:
    # Qwix lays the delta out as (contracted weight axes..., remaining weight axes...); the
    # weight's own axis order is the einsum's second operand.
    lhs, rhs = einsum_str.split("->")[0].split(",")
    delta_axes = [c for c in rhs if c in lhs] + [c for c in rhs if c not in lhs]
    return [delta_axes.index(c) for c in rhs]


# --- trainer LoRA checkpoints ------------------------------------------------------------------


def save_adapter_checkpoint(root: str | Path, params: Mapping[str, Any], metadata: CheckpointMetadata) -> Path:
    """Write a LoRA-only step `<root>/<metadata.step>` (layout above); returns the step directory."""
    root = Path(root).resolve()
    with ocp.CheckpointManager(
        root,
        item_names=("lora",),
        item_handlers={"lora": ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False)},
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
    ) as manager:
        manager.save(
            metadata.step,
            args=ocp.args.Composite(lora=ocp.args.PyTreeSave(dict(params))),
            custom_metadata=metadata.to_json(),
            force=True,
        )
    return root / str(metadata.step)


def resolve_step_dir(path: str | Path) -> Path:
    """A step directory: `path` itself if it holds a `lora` item, else the latest step under it."""
    path = Path(path).resolve()
    if (path / "lora").is_dir():
        return path
    steps = sorted((int(p.name), p) for p in path.glob("*") if p.name.isdigit() and (p / "lora").is_dir())
    if not steps:
        raise LoraError(f"{path} is not a LoRA checkpoint (no lora/ item, no <step>/lora/ below it)")
    return steps[-1][1]


def load_adapter_checkpoint(path: str | Path) -> tuple[dict[str, np.ndarray], CheckpointMetadata]:
    """(flat LoRA params as host arrays, metadata) of a step directory or checkpoint root."""
    step_dir = resolve_step_dir(path)
    step = int(step_dir.name)
    with ocp.CheckpointManager(step_dir.parent, item_handlers={"lora": ocp.PyTreeCheckpointHandler()}) as manager:
        custom = manager.metadata(step).custom_metadata
        if not custom:
            raise LoraError(f"{step_dir} has no LoRA metadata (rank, alpha, base model)")
        # As host arrays: the shardings of a multi-host run's save cannot be rebuilt in one process.
        saved = manager.item_metadata(step)["lora"].tree
        as_host = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), saved)
        tree = manager.restore(step, args=ocp.args.Composite(lora=ocp.args.PyTreeRestore(restore_args=as_host)))["lora"]
    params = {key: np.asarray(value) for key, value in weights.flatten(tree).items()}
    return params, CheckpointMetadata.from_json(custom)
