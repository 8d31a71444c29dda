"""The release kinds a tenants.json may use: a closed set, handed to loading as a parameter.

`ReleaseKinds` is a value: the kinds' models in the order the tenants.json reference lists them,
checked once (each a `ReleaseSpec` with `kind` a one-value Literal, no name twice, "none" among
them), and the `Tenant` and `Config` models whose `release` is the discriminated union of exactly
those kinds. Nothing is registered anywhere: the application builds its set where it is put together
(`proxy/engines/release_kinds.py`, the one list of the proxy's kinds) and passes it to
`proxy.config.loading`; a test adds a kind by building a larger set. So the same file validates the
same way in any interpreter, whatever else was imported.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import Field, create_model
from pydantic.fields import FieldInfo

from proxy.config.schema import Config, ReleaseSchema, ReleaseSpec, Tenant


class ReleaseKinds(Mapping[str, type[ReleaseSpec]]):
    """Kind name -> its model, in the order given; the models that validate a file with these kinds."""

    def __init__(self, models: Iterable[type[ReleaseSpec]]) -> None:
        table: dict[str, type[ReleaseSpec]] = {}
        for model in models:
            name = model.kind_name() if issubclass(model, ReleaseSpec) else None
            annotation = model.model_fields["kind"].annotation
            if name is None or get_origin(annotation) is not Literal or get_args(annotation) != (name,):
                raise TypeError(f"{model.__name__}: a release kind is a ReleaseSpec with "
                                "kind: Literal['its name'] = 'its name'")
            if name in table:
                raise ValueError(f"release kind {name!r} is listed twice ({table[name].__name__}, {model.__name__})")
            table[name] = model
        if "none" not in table:
            raise ValueError("release kind 'none' must be among the kinds: it is the default of every tenant")
        self._table = table

    def __getitem__(self, name: str) -> type[ReleaseSpec]:
        return self._table[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return f"ReleaseKinds({', '.join(self._table)})"

    @property
    def models(self) -> tuple[type[ReleaseSpec], ...]:
        return tuple(self._table.values())

    def adding(self, *models: type[ReleaseSpec]) -> ReleaseKinds:
        """These kinds and `models` after them (a test's or a plugin's own kind)."""
        return ReleaseKinds((*self.models, *models))

    def fields(self) -> dict[str, FieldInfo]:
        """Every field a release step may have, the base's first, then each kind's own in order (the
        tenants.json reference lists them so)."""
        out = dict(ReleaseSpec.model_fields)
        for model in self._table.values():
            out.update({name: info for name, info in model.model_fields.items() if name not in out})
        return out

    @functools.cached_property
    def tenant_model(self) -> type[Tenant]:
        """`Tenant` with `release` closed over these kinds (built on first use, once per set)."""
        base = Tenant.model_fields["release"]
        release: Any = Annotated[ReleaseSpec | list[ReleaseSpec], ReleaseSchema(dict(self._table))]
        field = Field(default_factory=base.default_factory, description=base.description)  # type: ignore[arg-type]
        return create_model("Tenant", __base__=Tenant, __module__=Tenant.__module__, release=(release, field))

    @functools.cached_property
    def config_model(self) -> type[Config]:
        """`Config` whose tenants are `tenant_model`s: what loading validates a file with."""
        base = Config.model_fields["tenants"]
        field = Field(default_factory=base.default_factory, description=base.description)  # type: ignore[arg-type]
        return create_model("Config", __base__=Config, __module__=Config.__module__,
                            tenants=(dict[str, self.tenant_model], field))  # type: ignore[name-defined]
