"""lorajob trainer: JAX/Tunix LoRA fine-tuning with Hugging Face interop.

`contract` (the config, the catalogue, the records, the exit codes...) imports without JAX: the operator imports it
and nothing else of the trainer.
"""
