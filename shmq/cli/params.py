"""The command line's parameter values: argv strings to the plain types shmq's
commands take (``str``, ``int``, ``float``, ``bool``, ``list[str]``), without pydantic.

typer (0.2x) coerces every parameter through a pydantic ``TypeAdapter``: importing
pydantic and building the adapters takes longer (about 120 ms) than the rest of a
CLI call.  ``install`` gives parameters of those plain types a converter of their own,
with click's messages (``'x' is not a valid integer.``); any other parameter (a parser,
bounds, choices, files, other types) keeps typer's coercion.  On a typer without that
hook ``install`` changes nothing: the CLI works as before, only slower to start
(``tests/cli/test_cli_startup.py`` notices).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_TRUE = {"1", "true", "t", "yes", "y", "on"}
_FALSE = {"", "0", "false", "f", "no", "n", "off"}


def _str(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(value)
    return int(value)


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(value)
    return float(value)


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(value)


def _strings(value: Any) -> list[str]:
    return [_str(v) for v in value]


# annotation -> (converter, what click calls a value of it)
CONVERTERS: dict[Any, tuple[Callable[[Any], Any], str]] = {
    str: (_str, "string"), int: (_int, "integer"), float: (_float, "float"), bool: (_bool, "boolean"),
    list[str]: (_strings, "list of strings"),
}


def install() -> bool:
    """Coerce the plain parameters of every typer command without pydantic; whether the
    hook was found."""
    try:
        from typer import core
        from typer._click.exceptions import BadParameter
        from typer._coercion import RuntimeParam, TypeDescriptor
    except ImportError:
        return False
    typers_own = getattr(core, "build_runtime_param", None)
    if typers_own is None:
        return False
    if getattr(typers_own, "plain_params", False):
        return True

    @dataclass(frozen=True)
    class PlainParam(RuntimeParam):
        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            convert, what = CONVERTERS[self.annotation]
            try:
                return convert(value)
            except (TypeError, ValueError):
                raise BadParameter(f"{value!r} is not a valid {what}.", ctx=ctx, param=param) from None

    def build_runtime_param(descriptor: TypeDescriptor) -> RuntimeParam:
        info = descriptor.parameter_info
        plain = (descriptor.annotation in CONVERTERS and descriptor.file_annotation is None
                 and info.parser is None and info.min is None and info.max is None)
        if not plain:
            return typers_own(descriptor)  # type: ignore[no-any-return]
        return PlainParam(parameter_info=info, annotation=descriptor.annotation)

    build_runtime_param.plain_params = True  # type: ignore[attr-defined]
    core.build_runtime_param = build_runtime_param
    return True
