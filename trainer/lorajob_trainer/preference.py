"""Preference tuning's losses: DPO (sigmoid, IPO, robust) and ORPO, as TRL's DPOTrainer and ORPOTrainer compute them.

A preference micro-batch holds pairs as consecutive rows: row 2i the prompt with the chosen answer, row 2i+1 the
same prompt with the rejected answer, each padded to the row's length on its own (never packed), so that a pair's
two rows lie on one device. A row's `weights` mark its answer's tokens (the prompt's are 0). The losses take each
row's per-position NLL from the chunked LM head (loss.chunked_token_nll) and sum the answer's log-probabilities:

- DPO compares them with the same sums under the reference: the model as training starts (the adapters as
  initialised, which compute the base; or the adapter the run was restored from), computed in the same step from
  the same base weights with the reference adapters in place of the trained ones.
- ORPO needs no reference: the chosen answers' NLL over their whole rows (prompt and answer, as TRL's ORPOTrainer
  computes it) minus lambda times the mean log-sigmoid of the pairs' log odds ratios of the answers' per-token mean
  log-probabilities.

A pair whose answer tokens were all cut off by the row's length (either answer) is left out of the loss and the
metrics; the step's mean is over the pairs it keeps (`StepCounts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from lorajob_trainer.contract.config import PreferenceConfig

REFERENCE_METHODS = ("dpo",)
"""The methods whose loss needs the reference model's log-probabilities."""


@dataclass(frozen=True)
class StepCounts:
    """What a step's loss is averaged over, counted over all its micro-batches before any forward pass."""

    pairs: jax.Array
    """Pairs kept (both answers have a token left)."""
    chosen_tokens: jax.Array
    """ORPO: the kept chosen rows' real positions (the NLL term's tokens)."""


jax.tree_util.register_dataclass(StepCounts, data_fields=["pairs", "chosen_tokens"], meta_fields=[])


def pair_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(chosen rows, rejected rows) of x [rows, ...]: x[0::2], x[1::2]."""
    return x[0::2], x[1::2]


def kept_pairs(weights: jax.Array) -> jax.Array:
    """[pairs] float32: 1 where both answers of the pair have a trained token, for weights [rows, length]."""
    chosen, rejected = pair_rows(jnp.sum(weights, axis=-1))
    return ((chosen > 0) & (rejected > 0)).astype(jnp.float32)


def chosen_positions(segment_ids: jax.Array) -> jax.Array:
    """[rows, length] bool: the real positions of the chosen rows (ORPO's NLL term)."""
    is_chosen = (jnp.arange(segment_ids.shape[-2]) % 2 == 0)[:, None]
    return is_chosen & (segment_ids != 0)


def step_counts(method: str, batch: dict[str, jax.Array]) -> StepCounts:
    """The counts of a step's batch [accumulation, rows, length]."""
    kept = jax.vmap(kept_pairs)(batch["weights"])
    chosen_tokens = jnp.zeros((), jnp.float32)
    if method == "orpo":
        per_pair = jax.vmap(lambda s: pair_rows(jnp.sum(chosen_positions(s), axis=-1))[0])(batch["segment_ids"])
        chosen_tokens = jnp.sum(per_pair * kept)
    return StepCounts(jnp.sum(kept), chosen_tokens)


def needed_positions(method: str, micro_batch: dict[str, jax.Array]) -> jax.Array:
    """[rows, length] bool: where the loss reads a log-probability."""
    answers = micro_batch["weights"] != 0
    return answers | chosen_positions(micro_batch["segment_ids"]) if method == "orpo" else answers


def answer_log_probs(nll: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of the answer's log-probabilities [rows], its token count [rows]) from per-position NLL [rows, length]."""
    return -jnp.sum(nll * weights, axis=-1), jnp.sum(weights, axis=-1)


@dataclass(frozen=True)
class PairTerms:
    """Per pair [pairs]: the loss, the rewards and the log-probabilities the metrics report."""

    loss: jax.Array
    chosen_rewards: jax.Array
    rejected_rewards: jax.Array
    chosen_logps: jax.Array
    rejected_logps: jax.Array


def dpo_terms(settings: PreferenceConfig, policy: jax.Array, reference: jax.Array, tokens: jax.Array) -> PairTerms:
    """DPO per pair from the answers' summed log-probabilities [rows] under the policy and the reference and their
    token counts [rows] (TRL's DPOTrainer, f-divergence reverse KL)."""
    chosen_ratio, rejected_ratio = pair_rows(policy - reference)
    beta = settings.beta
    margin = chosen_ratio - rejected_ratio
    if settings.loss_type == "sigmoid":
        loss = -jax.nn.log_sigmoid(beta * margin)
    elif settings.loss_type == "ipo":
        chosen_tokens, rejected_tokens = pair_rows(jnp.maximum(tokens, 1.0))
        loss = jnp.square(chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens - 1 / (2 * beta))
    elif settings.loss_type == "robust":
        smoothing = settings.label_smoothing
        loss = ((1 - smoothing) * -jax.nn.log_sigmoid(beta * margin)
                + smoothing * jax.nn.log_sigmoid(-beta * margin)) / (1 - 2 * smoothing)
    else:
        raise ValueError(f"unknown DPO loss type {settings.loss_type!r}")
    chosen_logps, rejected_logps = pair_rows(policy)
    return PairTerms(loss, jax.lax.stop_gradient(beta * chosen_ratio), jax.lax.stop_gradient(beta * rejected_ratio),
                     chosen_logps, rejected_logps)


def log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2."""
    return jnp.where(x < -jnp.log(2.0), jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def orpo_terms(settings: PreferenceConfig, mean_log_probs: jax.Array) -> PairTerms:
    """ORPO's odds-ratio term per pair (to be subtracted: `loss` is -lambda * log sigmoid(log odds ratio)) from
    the answers' per-token mean log-probabilities [rows] (TRL's ORPOTrainer)."""
    chosen, rejected = pair_rows(mean_log_probs)
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    weight = settings.orpo_lambda
    return PairTerms(-weight * jax.nn.log_sigmoid(log_odds), jax.lax.stop_gradient(weight * chosen),
                     jax.lax.stop_gradient(weight * rejected), chosen, rejected)


METRIC_SUMS = ("loss", "correct", "margin", "chosen_logps", "rejected_logps", "likelier")
"""The per-pair figures a step sums over its kept pairs (`pair_sums`)."""


def pair_sums(terms: PairTerms, kept: jax.Array, mean_log_probs: jax.Array) -> dict[str, jax.Array]:
    """Each of `METRIC_SUMS` summed over the kept pairs; `likelier` counts the pairs whose chosen answer has the higher
    per-token mean log-probability, from the answers' means [rows]."""
    chosen_mean, rejected_mean = pair_rows(mean_log_probs)
    values = {
        "loss": terms.loss,
        "correct": (terms.chosen_rewards > terms.rejected_rewards).astype(jnp.float32),
        "margin": terms.chosen_rewards - terms.rejected_rewards,
        "chosen_logps": terms.chosen_logps,
        "rejected_logps": terms.rejected_logps,
        "likelier": (chosen_mean > rejected_mean).astype(jnp.float32),
    }
    return {name: jnp.sum(jax.lax.stop_gradient(value) * kept) for name, value in values.items()}


def micro_objective(
    method: str,
    settings: PreferenceConfig,
    micro_batch: dict[str, jax.Array],
    policy_nll: jax.Array,
    reference_nll: jax.Array | None,
    counts: StepCounts,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(this micro-batch's share of the step's loss, its `pair_sums` and ORPO's NLL sum `nll`) from the per-position
    NLL [rows, length] of the policy and (DPO) the reference."""
    weights = micro_batch["weights"]
    kept = kept_pairs(weights)
    policy, tokens = answer_log_probs(policy_nll, weights)
    mean_log_probs = policy / jnp.maximum(tokens, 1.0)
    if method == "dpo":
        terms = dpo_terms(settings, policy, answer_log_probs(reference_nll, weights)[0], tokens)
    elif method == "orpo":
        terms = orpo_terms(settings, mean_log_probs)
    else:
        raise ValueError(f"{method!r} is not a preference method")
    pairs = jnp.maximum(counts.pairs, 1.0)
    objective = jnp.sum(terms.loss * kept) / pairs
    sums = pair_sums(terms, kept, mean_log_probs)
    if method == "orpo":
        kept_rows = jnp.repeat(kept, 2)[:, None]
        nll = jnp.sum(policy_nll * chosen_positions(micro_batch["segment_ids"]) * kept_rows)
        objective = objective + nll / jnp.maximum(counts.chosen_tokens, 1.0)
        sums["nll"] = jax.lax.stop_gradient(nll)
    return objective, sums


def step_metrics(method: str, sums: dict[str, jax.Array], counts: StepCounts) -> dict[str, jax.Array]:
    """The step's reported figures from its summed `micro_objective` sums: loss (the objective), reward accuracy and
    margin, the answers' mean log-probabilities; ORPO also its NLL term (`nll_loss`)."""
    pairs = jnp.maximum(counts.pairs, 1.0)
    metrics = {
        "loss": sums["loss"] / pairs,
        "reward_accuracy": sums["correct"] / pairs,
        "reward_margin": sums["margin"] / pairs,
        "chosen_logps": sums["chosen_logps"] / pairs,
        "rejected_logps": sums["rejected_logps"] / pairs,
        "pairs": counts.pairs,
    }
    if method == "orpo":
        metrics["nll_loss"] = sums["nll"] / jnp.maximum(counts.chosen_tokens, 1.0)
        metrics["loss"] = metrics["loss"] + metrics["nll_loss"]
    return metrics
