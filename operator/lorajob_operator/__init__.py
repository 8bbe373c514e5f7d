"""lorajob operator: the LoRAJob API, its CRD, rendering of child JobSets, and the kopf handlers.

Lives in the folder `operator/` (which is never on sys.path: `operator` is a stdlib module).
"""
