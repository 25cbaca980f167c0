"""Queue policies (DESIGN §4): durations, each key's parsing and canonical text, assignments,
and the defaults. Pure: no store, no clock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spoolfs.core import policy as P
from spoolfs.core.errors import Invalid
from spoolfs.core.policy import DEFAULT, KEYS, NS, Policy

MIN = 60 * NS
HOUR = 3600 * NS
DAY = 86400 * NS


# ---- durations --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, ns", [
    ("45", 45 * NS),
    ("45s", 45 * NS),
    ("10m", 10 * MIN),
    ("2h", 2 * HOUR),
    ("7d", 7 * DAY),
    ("1w", 7 * DAY),
    ("0", 0),
    ("0s", 0),
    (" 10M ", 10 * MIN),  # surrounding blanks and upper case are forgiven
    ("90", 90 * NS),
])
def test_parse_duration(text: str, ns: int) -> None:
    assert P.parse_duration(text) == ns


@pytest.mark.parametrize("text", ["5x", "-1", "", " ", "1.5h", "m", "10 m", "1h30m", "1e3",
                                  "+5", "ten", "5ms", "0x10"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(Invalid) as exc:
        P.parse_duration(text)
    msg = str(exc.value)
    assert "bad duration" in msg and repr(text) in msg  # says what was wrong and with what


@pytest.mark.parametrize("ns, text", [
    (0, "0s"),
    (45 * NS, "45s"),
    (90 * NS, "90s"),
    (10 * MIN, "10m"),
    (2 * HOUR, "2h"),
    (90 * MIN, "90m"),
    (7 * DAY, "7d"),
    (DAY + NS, "86401s"),
])
def test_show_duration(ns: int, text: str) -> None:
    assert P.show_duration(ns) == text


UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


@given(st.integers(min_value=0, max_value=10**7), st.sampled_from(sorted(UNIT_S)))
def test_duration_round_trips_or_is_refused_beyond_100_years(n: int, unit: str) -> None:
    if n * UNIT_S[unit] * NS > P.MAX_DURATION:
        with pytest.raises(Invalid, match="longer than 100 years"):
            P.parse_duration(f"{n}{unit}")
        return
    ns = P.parse_duration(f"{n}{unit}")
    assert ns % NS == 0 and ns >= 0
    assert P.parse_duration(P.show_duration(ns)) == ns  # the canonical text means the same


def test_a_duration_the_store_could_not_hold_is_refused() -> None:
    with pytest.raises(Invalid):
        P.parse("lease_timeout", "10000000000")
    assert P.parse("lease_timeout", "36500d") == P.MAX_DURATION


# ---- each key -----------------------------------------------------------------------------------

@pytest.mark.parametrize("key, text, value, shown", [
    ("lease_timeout", "10m", 10 * MIN, "10m"),
    ("lease_timeout", "45", 45 * NS, "45s"),
    ("lease_timeout", "1w", 7 * DAY, "7d"),
    ("max_attempts", "3", 3, "3"),
    ("max_attempts", " 1 ", 1, "1"),
    ("max_attempts", "100", 100, "100"),
    ("retry_backoff", "0", 0, "0s"),
    ("retry_backoff", "30s", 30 * NS, "30s"),
    ("retry_backoff_max", "1h", HOUR, "1h"),
    ("retry_errors", "on", True, "on"),
    ("retry_errors", "ON", True, "on"),
    ("retry_errors", "yes", True, "on"),
    ("retry_errors", "true", True, "on"),
    ("retry_errors", "1", True, "on"),
    ("retry_errors", "off", False, "off"),
    ("retry_errors", "no", False, "off"),
    ("retry_errors", "false", False, "off"),
    ("retry_errors", "0", False, "off"),
    ("success_retention", "7d", 7 * DAY, "7d"),
    ("success_retention", "forever", None, "forever"),
    ("success_retention", "never", None, "forever"),
    ("error_retention", "2h", 2 * HOUR, "2h"),
    ("error_retention", "off", None, "forever"),
    ("error_retention", "none", None, "forever"),
    ("error_retention", "Forever", None, "forever"),
])
def test_parse_and_show_each_key(key: str, text: str, value: object, shown: str) -> None:
    assert P.parse(key, text) == value
    assert P.show(key, P.parse(key, text)) == shown
    assert P.parse(key, shown) == value  # the canonical text parses back to the same value


@pytest.mark.parametrize("key, text, words", [
    ("lease_timeout", "0", "longer than 0"),
    ("lease_timeout", "0s", "longer than 0"),
    ("lease_timeout", "forever", "bad duration"),
    ("lease_timeout", "-5m", "bad duration"),
    ("max_attempts", "0", "at least 1"),
    ("max_attempts", "-1", "at least 1"),
    ("max_attempts", "2.5", "at least 1"),
    ("max_attempts", "", "at least 1"),
    ("max_attempts", "five", "at least 1"),
    ("retry_backoff", "soon", "bad duration"),
    ("retry_backoff_max", "1y", "bad duration"),
    ("retry_errors", "maybe", "on or off"),
    ("retry_errors", "", "on or off"),
    ("success_retention", "7x", "bad duration"),
    ("error_retention", "-1d", "bad duration"),
])
def test_parse_refuses_bad_values(key: str, text: str, words: str) -> None:
    with pytest.raises(Invalid) as exc:
        P.parse(key, text)
    assert words in str(exc.value)


def test_parse_refuses_unknown_key_and_lists_the_keys() -> None:
    with pytest.raises(Invalid) as exc:
        P.parse("lease", "10m")
    msg = str(exc.value)
    assert "unknown policy key 'lease'" in msg
    assert all(k in msg for k in KEYS)


@given(st.sampled_from(KEYS), st.text(max_size=12))
def test_parse_accepts_or_refuses_cleanly(key: str, text: str) -> None:
    """Whatever an operator types, the answer is a value or ``Invalid`` with a message (the
    CLI prints it; the xattr answers EINVAL): never another exception, which would surface as
    a traceback or an EIO."""
    try:
        value = P.parse(key, text)
    except Invalid as e:
        assert str(e)
    else:
        assert P.parse(key, P.show(key, value)) == value


@pytest.mark.parametrize("text", ["²", "³", "①"])
def test_max_attempts_refuses_non_decimal_digits_cleanly(text: str) -> None:
    """``str.isdigit`` is true for superscripts and circled digits, which ``int`` refuses."""
    with pytest.raises(Invalid):
        P.parse("max_attempts", text)


# ---- assignments ------------------------------------------------------------------------------

def test_parse_assignments_several_at_once_canonical() -> None:
    got = P.parse_assignments(["lease_timeout=600", "max_attempts=3", "retry_errors=YES",
                               "error_retention=never", "retry_backoff=120"])
    assert got == {"lease_timeout": "10m", "max_attempts": "3", "retry_errors": "on",
                   "error_retention": "forever", "retry_backoff": "2m"}


def test_parse_assignments_empty_and_last_wins() -> None:
    assert P.parse_assignments([]) == {}
    assert P.parse_assignments(["max_attempts=2", "max_attempts=7"]) == {"max_attempts": "7"}


@pytest.mark.parametrize("args, words", [
    (["lease_timeout=10m", "colour=blue"], "unknown policy key 'colour'"),
    (["max_attempts=3", "lease_timeout=5x"], "bad duration '5x'"),
    (["max_attempts"], "expected key=value, got 'max_attempts'"),
    (["retry_errors=sometimes"], "bad retry_errors 'sometimes'"),
    (["=10m"], "unknown policy key ''"),
])
def test_parse_assignments_refuses_with_a_clear_message(args: list[str], words: str) -> None:
    with pytest.raises(Invalid) as exc:
        P.parse_assignments(args)
    assert words in str(exc.value)


def test_parse_lines_reads_the_xattr_format() -> None:
    text = "lease_timeout=30s\nmax_attempts=2\n"
    assert P.parse_lines(text) == {"lease_timeout": "30s", "max_attempts": "2"}
    assert P.parse_lines(P.format_lines(DEFAULT.shown())) == DEFAULT.shown()


# ---- Policy ---------------------------------------------------------------------------------

def test_defaults_are_those_of_design() -> None:
    p = Policy()
    assert p == DEFAULT
    assert p.lease_timeout == 10 * MIN
    assert p.max_attempts == 5
    assert p.retry_backoff == 0
    assert p.retry_errors is False
    assert p.success_retention is None and p.error_retention is None  # keep forever
    assert p.retry_backoff_max >= p.retry_backoff
    assert p.shown() == {
        "lease_timeout": "10m", "max_attempts": "5", "retry_backoff": "0s",
        "retry_backoff_max": "1h", "retry_errors": "off", "success_retention": "forever",
        "error_retention": "forever", "fanout": "none", "duplicates": "allow",
        "duplicates_window": "7d", "max_age.partial": "none", "max_age.ready": "none",
        "max_age.working": "none", "max_error": "none", "max_working_per_consumer": "none",
        "idle_views": "off", "min_free": "auto",
    }
    assert set(p.shown()) == set(KEYS)


@pytest.mark.parametrize("text, value, shown", [
    ("billing,audit", ("billing", "audit"), "billing,audit"),
    (" a , b ", ("a", "b"), "a,b"),
    ("none", (), "none"),
    ("", (), "none"),
])
def test_fanout_values(text: str, value: tuple[str, ...], shown: str) -> None:
    assert P.parse("fanout", text) == value
    assert P.show("fanout", value) == shown


@pytest.mark.parametrize("text", ["a,a", "a,.b", "a b", "x/y"])
def test_fanout_refusals(text: str) -> None:
    with pytest.raises(Invalid):
        P.parse("fanout", text)


def test_fanout_cycles_are_refused() -> None:
    P.check_fanout({"t": ("a", "b"), "a": ("c",), "b": ("c",), "c": ()})  # a diamond is fine
    P.check_fanout({"t": ("missing",)})  # a subscriber that does not exist yet is no cycle
    with pytest.raises(Invalid, match="t -> a -> t"):
        P.check_fanout({"t": ("a",), "a": ("t",)})
    with pytest.raises(Invalid, match="cycle"):
        P.check_fanout({"t": ("t",)})


@pytest.mark.parametrize("text", ["allow", "reject", "skip", " SKIP "])
def test_duplicates_values(text: str) -> None:
    assert P.parse("duplicates", text) == text.strip().lower()
    with pytest.raises(Invalid):
        P.parse("duplicates", "drop")
    assert set(KEYS) == set(P.HELP)  # every key is explained to the operator


def test_with_values_applies_raw_texts_and_leaves_the_rest() -> None:
    p = DEFAULT.with_values({"lease_timeout": "30s", "retry_errors": "on",
                             "success_retention": "1d"})
    assert p.lease_timeout == 30 * NS and p.retry_errors is True and p.success_retention == DAY
    assert p.max_attempts == DEFAULT.max_attempts and p.error_retention is None
    assert DEFAULT.lease_timeout == 10 * MIN  # the original is unchanged (frozen)
    assert p.with_values({}) == p
    assert p.with_values({"success_retention": "forever"}).success_retention is None


def test_with_values_refuses_a_bad_value_or_key() -> None:
    with pytest.raises(Invalid):
        DEFAULT.with_values({"max_attempts": "0"})
    with pytest.raises(Invalid):
        DEFAULT.with_values({"nope": "1"})


@given(st.fixed_dictionaries({}, optional={
    "lease_timeout": st.integers(1, 10**6).map(lambda n: f"{n}s"),
    "max_attempts": st.integers(1, 1000).map(str),
    "retry_backoff": st.integers(0, 10**5).map(lambda n: f"{n}m"),
    "retry_errors": st.sampled_from(["on", "off", "yes", "no"]),
    "error_retention": st.one_of(st.just("forever"), st.integers(1, 100).map(lambda n: f"{n}d")),
}))
def test_shown_round_trips(values: dict[str, str]) -> None:
    p = DEFAULT.with_values(values)
    assert DEFAULT.with_values(p.shown()) == p


@pytest.mark.parametrize("text, shown", [("1h", "1h"), ("90", "90s"), ("off", "off"),
                                         ("never", "off")])
def test_idle_views_is_a_duration_or_off(text: str, shown: str) -> None:
    assert P.parse_assignments([f"idle_views={text}"]) == {"idle_views": shown}


@pytest.mark.parametrize("text", ["0s", "-1", "soon"])
def test_idle_views_refuses_what_is_no_positive_duration(text: str) -> None:
    with pytest.raises(Invalid):
        P.parse_assignments([f"idle_views={text}"])
