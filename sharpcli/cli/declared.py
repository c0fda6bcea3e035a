"""Options declared once, as the fields of a dataclass, and given to commands as one object.

A field made by :func:`option` carries its typer option (an ``Annotated`` type) in its
metadata and the option's default as its own. :func:`with_options` puts the fields of such a
dataclass (an :class:`OptionSet`: all of them, or a subset in a chosen order with some helps
reworded) into a command's signature in place of one parameter, and hands the command the
dataclass built from the values parsed. Two commands that share options declare them in one
dataclass (``train`` and ``sweep``: :class:`sharpcli.cli.train_options.TrainOptions`; the
analysis commands: :class:`sharpcli.cli.common.CommonOptions`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def option(annotated: Any, default: Any) -> Any:
    """A dataclass field declaring one option: ``default`` is the option's default and the
    field's metadata holds ``annotated`` (``Annotated[type, typer.Option(...)]``)."""
    return dataclasses.field(default=default, metadata={"option": annotated})


def reworded(annotated: Any, help: str) -> Any:
    """``annotated`` (an ``Annotated`` option type) with its option's help replaced."""
    base, info, *rest = typing.get_args(annotated)
    info = copy.copy(info)
    info.help = help
    return Annotated.__class_getitem__((base, info, *rest))  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class OptionSet:
    """The options of a dataclass that one command takes.

    Attributes:
        cls: a dataclass whose fields are :func:`option` fields (others are not options).
        names: the fields taken, in the order their options are listed; None: every option
            field in declaration order. The others keep their defaults.
        help: helps that read differently in this command, by field name.
    """

    cls: type
    names: tuple[str, ...] | None = None
    help: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def fields(self) -> list[dataclasses.Field]:
        """The option fields taken, in order."""
        declared = {f.name: f for f in dataclasses.fields(self.cls) if "option" in f.metadata}
        names = self.names if self.names is not None else tuple(declared)
        unknown = [n for n in [*names, *self.help] if n not in declared]
        if unknown:
            raise TypeError(f"{self.cls.__name__} declares no option {', '.join(unknown)}")
        return [declared[n] for n in names]

    def parameters(self) -> list[inspect.Parameter]:
        """The keyword parameters, typer options annotated, that a command's signature gets."""
        params = []
        for f in self.fields():
            annotated = f.metadata["option"]
            if f.name in self.help:
                annotated = reworded(annotated, self.help[f.name])
            params.append(
                inspect.Parameter(
                    f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=annotated
                )
            )
        return params

    def build(self, values: dict[str, Any]) -> Any:
        """The dataclass of the parsed ``values`` of its fields (taken out of ``values``)."""
        return self.cls(**{f.name: values.pop(f.name) for f in self.fields()})


def with_options(**sets: OptionSet | type) -> Callable[[F], F]:
    """Replace parameters of a command function by the options of dataclasses.

    Each keyword names a parameter of the decorated function; in the signature typer reads,
    that parameter becomes the options of its :class:`OptionSet` (a dataclass: all of its
    options), at its place; when the command runs, the function receives the dataclass built
    from them under the parameter's name.

    Args:
        **sets: parameter name -> the options that stand for it.

    Returns:
        The decorator (apply it below ``app.command``).
    """
    resolved = {k: v if isinstance(v, OptionSet) else OptionSet(v) for k, v in sets.items()}

    def decorate(func: F) -> F:
        sig = inspect.signature(func)
        hints = typing.get_type_hints(func, include_extras=True)  # the module's string annotations
        params: list[inspect.Parameter] = []
        for p in sig.parameters.values():
            if p.name in resolved:
                params += resolved[p.name].parameters()
            else:
                params.append(p.replace(annotation=hints.get(p.name, p.annotation)))
        names = [p.name for p in params]
        clashes = sorted({n for n in names if names.count(n) > 1})
        if clashes:
            raise TypeError(f"{func.__name__}: options declared twice: {', '.join(clashes)}")

        @functools.wraps(func)
        def wrapper(**kwargs: Any) -> Any:
            for name, option_set in resolved.items():
                kwargs[name] = option_set.build(kwargs)
            return func(**kwargs)

        # typer passes every parameter by keyword, so the options may sit between others
        keyword = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params]
        setattr(wrapper, "__signature__", sig.replace(parameters=keyword, return_annotation=None))
        wrapper.__annotations__ = {p.name: p.annotation for p in keyword}
        del wrapper.__wrapped__  # typer must read __signature__, not the function's own
        return typing.cast(F, wrapper)

    return decorate
