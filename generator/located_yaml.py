"""YAML loading that remembers where every value came from, so errors can name file and line."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Where:
    file: str
    line: int  # 1-based

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


class LocatedDict(dict):
    """A mapping whose keys' and values' source lines are kept in `where` and `key_where`."""

    where: Where
    key_where: dict[Any, Where]


class YamlSyntaxError(SyntaxError):
    """Not valid YAML; `where` is the line of the problem."""

    def __init__(self, where: Where, message: str):
        self.where = where
        super().__init__(message)


class LocatedList(list):
    where: Where
    item_where: list[Where]


def _where(file: str, node: yaml.Node) -> Where:
    return Where(file, node.start_mark.line + 1)


def _convert(node: yaml.Node, file: str, constructor: yaml.constructor.SafeConstructor) -> Any:
    if isinstance(node, yaml.MappingNode):
        out = LocatedDict()
        out.where, out.key_where = _where(file, node), {}
        for key_node, value_node in node.value:
            key = _convert(key_node, file, constructor)
            if isinstance(key, (dict, list)):
                raise YamlSyntaxError(_where(file, key_node), "a mapping key must be a scalar")
            out[key] = _convert(value_node, file, constructor)
            out.key_where[key] = _where(file, key_node)
        return out
    if isinstance(node, yaml.SequenceNode):
        out = LocatedList(_convert(item, file, constructor) for item in node.value)
        out.where = _where(file, node)
        out.item_where = [_where(file, item) for item in node.value]
        return out
    return constructor.construct_object(node, deep=True)


def load(path: Path, display_name: str | None = None) -> Any:
    """Parse one YAML document into plain dicts/lists/scalars that carry their source lines."""
    file = display_name or str(path)
    text = path.read_text()
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = Where(file, mark.line + 1 if mark else 1)
        raise YamlSyntaxError(where, f"not valid YAML: {exc.problem or exc.context}") from None
    if node is None:  # an empty document: an empty mapping, located at its first line
        empty = LocatedDict()
        empty.where, empty.key_where = Where(file, 1), {}
        return empty
    return _convert(node, file, yaml.SafeLoader(""))
