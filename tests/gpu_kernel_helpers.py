"""What the Triton-kernel tests share: counting a module's kernel launches, so that no test passes
through the torch fallback unnoticed."""


def count_launches(monkeypatch, module) -> list:
    """Names of the kernels ``module._launch`` starts from now on (the list fills as they run)."""
    names = []
    real = module._launch

    def counting(kernel, grid, *args, **meta):
        names.append(kernel.__name__)
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(module, "_launch", counting)
    return names
