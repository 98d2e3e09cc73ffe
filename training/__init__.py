"""Training the embedded default: a tiny NemotronH target and every draft kind, on this machine's CPU.

Nothing here runs at serve or build time; ``python -m training.train_embedded`` reproduces the
checkpoints shipped in ``builder/embedded`` (fixed seeds).
"""
