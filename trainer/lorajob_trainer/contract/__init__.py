"""What the operator and the trainer share: the training config, the model catalogue, the run's layout and the records
its steps print, the exit codes, the environment the operator renders into pods, and the fit check's request and plan.

The rule: modules here import the standard library, pydantic and yaml, and nothing of lorajob_trainer outside this
package (no JAX, Flax, NumPy, Optax, Tunix): the operator imports them and nothing else of the trainer
(tests/operator/test_jax_free.py holds both sides to it).
"""
