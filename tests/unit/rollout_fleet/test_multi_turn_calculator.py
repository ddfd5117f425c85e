"""The calculator environment: exact arithmetic, bounded input, refusals that never run code."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest

from rollout_fleet.multi_turn import calculator
from rollout_fleet.multi_turn.calculator import CalcError, answer, calculator_env, evaluate

VALUES = [
    ("1+2", Fraction(3)),
    ("2+3*4", Fraction(14)),
    ("(2+3)*4", Fraction(20)),
    ("47*86+3", Fraction(4045)),
    ("10/4", Fraction(5, 2)),
    ("1/3+1/3+1/3", Fraction(1)),
    ("-5+2", Fraction(-3)),
    ("--5", Fraction(5)),
    ("-(2+3)", Fraction(-5)),
    ("+7", Fraction(7)),
    ("8-2-1", Fraction(5)),  # left-associative
    ("8/2/2", Fraction(2)),
    ("1.5*2", Fraction(3)),
    (".5+.25", Fraction(3, 4)),
    ("  3 *\n 4  ", Fraction(12)),
]


@pytest.mark.parametrize(("expression", "value"), VALUES)
def test_evaluates_arithmetic_exactly_with_precedence(expression, value):
    assert evaluate(expression) == value


REFUSED = [
    ("", "empty expression"),
    ("   ", "empty expression"),
    ("1/0", "division by zero"),
    ("1/(2-2)", "division by zero"),
    ("1+", "ends too early"),
    ("(1+2", "unbalanced parenthesis"),
    ("1+2)", "unexpected token"),
    ("*3", "unexpected operator"),
    ("2**3", "unexpected operator"),  # no powers
    ("1e9", "unsupported character"),
    ("0x10", "unsupported character"),
    ("abs(-1)", "unsupported character"),
    ("__import__('os').system('true')", "unsupported character"),
    ("().__class__", "unsupported character"),
    ("()", "unexpected operator"),
    ("1; 2", "unsupported character"),
    ("2^3", "unsupported character"),
    ("9" * 25, "longer than 24 digits"),
    ("1+" * 150 + "1", "longer than 200 characters"),
    ("(" * 40 + "1" + ")" * 40, "nested deeper than 32"),
    ("-" * 60 + "1", "nested deeper than 32"),
    ("999999999999*999999999999", "result beyond"),
]


@pytest.mark.parametrize(("expression", "reason"), REFUSED)
def test_refuses_bad_or_malicious_input_with_a_reason(expression, reason):
    with pytest.raises(CalcError, match=re.escape(reason)):
        evaluate(expression)


@pytest.mark.parametrize(
    ("expression", "reply"),
    [
        ("6*7", "42"),
        ("10/4", "2.5"),
        ("1/3", "0.333333"),
        ("2/3", "0.666667"),
        ("-1/8", "-0.125"),
        ("1/3000000", "0"),
        ("-1/3000000", "0"),
        ("7/7", "1"),
        ("1/0", "error: division by zero"),
    ],
)
def test_replies_with_the_value_or_an_error(expression, reply):
    assert answer(expression) == reply


def test_error_replies_never_echo_the_expression():
    for expression in ("#### 42", "ignore <calc>1</calc> ####9", "print('####')"):
        reply = answer(expression)
        assert reply.startswith("error: ") and "#" not in reply and "print" not in reply


def test_env_answers_every_call_of_the_last_turn_in_order_and_is_done_without_one():
    turn = {
        "role": "assistant",
        "content": "<calc>2+2</calc> and <calc>3*(1</calc> <calc>9/3</calc>",
    }
    reply = calculator_env([{"role": "user", "content": "q"}, turn], {})
    assert reply == {"role": "tool", "content": "4\nerror: unbalanced parenthesis\n3"}
    earlier_call = [{"role": "assistant", "content": "<calc>1+1</calc>"}, {"role": "tool"}]
    assert calculator_env([*earlier_call, {"role": "assistant", "content": "#### 2"}], {}) is None


def test_env_answers_at_most_max_calls_per_turn():
    content = "<calc>1</calc>" * (calculator.MAX_CALLS_PER_TURN + 5)
    reply = calculator_env([{"role": "assistant", "content": content}], None)
    assert reply is not None
    assert reply["content"].split("\n") == ["1"] * calculator.MAX_CALLS_PER_TURN
