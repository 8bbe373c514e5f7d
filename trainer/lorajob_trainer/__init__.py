"""lorajob trainer: JAX/Tunix LoRA fine-tuning with Hugging Face interop.

`catalog` and `config` import without JAX, so the operator can build command lines from them.
"""
