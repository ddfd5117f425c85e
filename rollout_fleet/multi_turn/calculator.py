"""The built-in ``calculator`` environment: the policy writes ``<calc>EXPR</calc>``, the tool answers.

After each generated turn, every ``<calc>...</calc>`` in it (at most
``MAX_CALLS_PER_TURN``) is evaluated and the results come back as one
``tool`` message, one line per call in order: the value, or ``error: <why>``.
A turn without a call ends the conversation (the policy gave its answer).

Evaluation is a small recursive-descent parser over exact rationals, never
``eval()``: decimal numbers, ``+ - * /``, unary ``+``/``-`` and parentheses,
nothing else (no names, no powers, no calls). Input is bounded before work is
done (``MAX_EXPRESSION_CHARS``, ``MAX_NUMBER_DIGITS``, ``MAX_DEPTH``) and so is
every result (``MAX_ABS_VALUE``). A value prints as an integer when it is one,
else as a decimal rounded to ``DECIMALS`` places. Error texts never echo the
expression, so a tool reply cannot carry text the policy did not write (the
``synth/calc`` scorer reads the answer after ``####``, which no reply holds).
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, Decimal
from fractions import Fraction
from typing import Any

MAX_CALLS_PER_TURN = 8
MAX_EXPRESSION_CHARS = 200
MAX_NUMBER_DIGITS = 24
MAX_DEPTH = 32
MAX_ABS_VALUE = 10**18
DECIMALS = 6

CALL_RE = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_TOKEN_RE = re.compile(r"\s*(?:(\d+(?:\.\d+)?|\.\d+)|([-+*/()]))")


class CalcError(ValueError):
    """An expression the calculator refuses; the text is the reason (never the input)."""


class _Parser:
    """expr := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*;
    factor := ('+'|'-') factor | number | '(' expr ')'."""

    def __init__(self, text: str) -> None:
        self.tokens = _tokenize(text)
        self.position = 0

    def parse(self) -> Fraction:
        if not self.tokens:
            raise CalcError("empty expression")
        value = self._expr(0)
        if self.position != len(self.tokens):
            raise CalcError(f"unexpected token at position {self.position + 1}")
        return value

    def _peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise CalcError("expression ends too early")
        self.position += 1
        return token

    def _expr(self, depth: int) -> Fraction:
        value = self._term(depth)
        while self._peek() in ("+", "-"):
            op = self._take()
            right = self._term(depth)
            value = _bounded(value + right if op == "+" else value - right)
        return value

    def _term(self, depth: int) -> Fraction:
        value = self._factor(depth)
        while self._peek() in ("*", "/"):
            op = self._take()
            right = self._factor(depth)
            if op == "/" and right == 0:
                raise CalcError("division by zero")
            value = _bounded(value * right if op == "*" else value / right)
        return value

    def _factor(self, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise CalcError(f"nested deeper than {MAX_DEPTH}")
        token = self._take()
        if token in ("+", "-"):
            value = self._factor(depth + 1)
            return -value if token == "-" else value
        if token == "(":
            value = self._expr(depth + 1)
            if self._peek() != ")":
                raise CalcError("unbalanced parenthesis")
            self.position += 1
            return value
        if token in ("*", "/", ")"):
            raise CalcError(f"unexpected operator at position {self.position}")
        return Fraction(token)


def _tokenize(text: str) -> list[str]:
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens: list[str] = []
    position = 0
    stripped_end = len(text.rstrip())
    while position < stripped_end:
        match = _TOKEN_RE.match(text, position)
        if match is None:
            offending = len(text) - len(text[position:].lstrip())
            raise CalcError(f"unsupported character at position {offending + 1}")
        number, operator = match.groups()
        if number is not None and len(number.replace(".", "")) > MAX_NUMBER_DIGITS:
            raise CalcError(f"a number longer than {MAX_NUMBER_DIGITS} digits")
        tokens.append(number if number is not None else operator)
        position = match.end()
    return tokens


def _bounded(value: Fraction) -> Fraction:
    if abs(value) > MAX_ABS_VALUE:
        raise CalcError(f"result beyond {MAX_ABS_VALUE:.0e}")
    return value


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; ``CalcError`` if it is refused."""
    return _Parser(expression).parse()


def format_value(value: Fraction) -> str:
    """``12``, ``-0.333333``, ``2.5``: integers plainly, other values to ``DECIMALS`` places."""
    if value.denominator == 1:
        return str(value.numerator)
    quantum = Decimal(1).scaleb(-DECIMALS)
    exact = Decimal(value.numerator) / Decimal(value.denominator)
    rounded = exact.quantize(quantum, rounding=ROUND_HALF_EVEN)
    if rounded == 0:
        return "0"  # not "-0"
    return format(rounded, "f").rstrip("0").rstrip(".")


def answer(expression: str) -> str:
    """What the tool replies to one call: the value, or ``error: <why>``."""
    try:
        return format_value(evaluate(expression))
    except CalcError as err:
        return f"error: {err}"


def calculator_env(messages: list[dict[str, Any]], extra_info: Any = None) -> dict[str, str] | None:
    """The environment function: a ``tool`` reply to the last turn's calls, or None (done)."""
    calls = CALL_RE.findall(str(messages[-1].get("content", "")))
    if not calls:
        return None
    return {"role": "tool", "content": "\n".join(answer(c) for c in calls[:MAX_CALLS_PER_TURN])}
