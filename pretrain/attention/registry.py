"""Name → token-mixer class, so configs choose mixers and the model never names one."""
import inspect

from torch import nn

REGISTRY: dict[str, type[nn.Module]] = {}


def register(name: str):
    """Class decorator: make a mixer constructible by ``name`` from configs and tools."""

    def add(cls: type[nn.Module]) -> type[nn.Module]:
        if name in REGISTRY:
            raise ValueError(f"mixer {name!r} is registered twice ({REGISTRY[name].__name__}, {cls.__name__})")
        REGISTRY[name] = cls
        return cls

    return add


def mixer_options(name: str) -> dict[str, object]:
    """The keyword options a mixer accepts, with their defaults (for validation and docs)."""
    params = inspect.signature(REGISTRY[name].__init__).parameters
    fixed = {"self", "dim", "num_heads", "causal"}
    return {
        p.name: p.default
        for p in params.values()
        if p.name not in fixed and p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def build_mixer(name: str, dim: int, num_heads: int, *, causal: bool, options: dict | None = None) -> nn.Module:
    """Construct a registered mixer; unknown names, unknown options and impossible causality fail here."""
    if name not in REGISTRY:
        raise ValueError(f"unknown mixer {name!r}; registered: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[name]
    if causal and not cls.supports_causal:
        raise ValueError(f"mixer {name!r} has no causal form and cannot be used in a causal model")
    options = dict(options or {})
    known = mixer_options(name)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for mixer {name!r}; known: {sorted(known)}")
    return cls(dim, num_heads, causal=causal, **options)
