"""The command line's parameter values: argv strings to the plain types shmq's
commands take (``str``, ``int``, ``float``, ``bool``, ``list[str]``), without pydantic.

typer (0.2x) coerces every parameter through a pydantic ``TypeAdapter``: importing
pydantic and building the adapters takes longer (about 120 ms) than the rest of a
CLI call.  ``install`` gives parameters of those plain types a converter of their own,
with click's messages (``'x' is not a valid integer.``); any other parameter (a parser,
bounds, choices, files, other types) keeps typer's coercion.  On a typer without that
hook ``install`` changes nothing: the CLI works as before, only slower to start
(``tests/cli/test_cli_startup.py`` notices).

``install`` also gives the help click's plain placeholders (``TEXT``, ``INTEGER``,
``FLOAT``; nothing after a flag; ``QUEUE`` in the usage line) where typer 0.2x shows the
Python types (``<str>``, ``<bool>``, ``<list[str]>``) and braces (``{QUEUE}``): ``plain_help``.
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


# a type's word in help, as click says it
WORDS = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT", "bool": "BOOLEAN", "datetime": "DATETIME"}


def plain_word(label: str) -> str:
    """typer's type label (``<int>``, ``<list[str]>``, ``<a|b>``, ``<int range>``) as click
    says it: ``INTEGER``, ``TEXT``, ``[a|b]``, ``INTEGER RANGE``."""
    inner = label[1:-1] if label.startswith("<") and label.endswith(">") else label
    while inner.startswith("list[") and inner.endswith("]"):  # repeated: each value's word
        inner = inner[5:-1]
    if "|" in inner:  # choices
        return f"[{inner}]"
    return " ".join(WORDS.get(w, w.upper()) for w in inner.split())


def plain_help() -> bool:
    """Help with click's placeholders rather than typer's Python types: an option's value is
    its metavar, else its type's word (``plain_word``), and a flag shows none; an argument
    shows its name in capitals (its metavar, if given), in the usage line without braces.
    Whether typer had the methods this replaces (else its help is left as it is)."""
    try:
        from typer import core
    except ImportError:
        return False
    param, argument, option = (getattr(core, n, None) for n in ("_TyperParameter", "TyperArgument",
                                                                 "TyperOption"))
    if param is None or argument is None or option is None:
        return False
    if getattr(param, "plain_help", False):
        return True
    if not all(hasattr(c, m) for c, m in ((param, "display_type"), (param, "display_type_rich"),
                                          (option, "display_type_rich"), (argument, "display_name_raw"),
                                          (argument, "_usage_display_name"))):
        return False
    typers_type = param.display_type

    def display_type(self: Any, ctx: Any) -> str:
        return plain_word(typers_type(self, ctx))

    def option_type(self: Any, ctx: Any) -> str | None:
        if self.is_flag or self.count:
            return None
        if self.metavar is not None:
            return str(self.metavar)
        return self.display_type(ctx) + ("..." if self.nargs != 1 else "")

    def argument_type(self: Any, ctx: Any) -> str | None:
        return None if self.metavar is not None else self.display_type(ctx)  # the name says it all

    def argument_name(self: Any) -> str:
        return str(self.metavar if self.metavar is not None else self.name.upper())

    def usage_name(self: Any) -> str:
        name = self.display_name_raw if self.required else f"[{self.display_name_raw}]"
        return name + ("..." if self.nargs != 1 else "")

    param.display_type = display_type
    option.display_type_rich = option_type
    argument.display_type_rich = argument_type
    argument.display_name_raw = property(argument_name)
    argument._usage_display_name = usage_name
    param.plain_help = True
    return True


def install() -> bool:
    """Coerce the plain parameters of every typer command without pydantic, and show plain
    placeholders in help (``plain_help``); whether the coercion hook was found."""
    plain_help()
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
