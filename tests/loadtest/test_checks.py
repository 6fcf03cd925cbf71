"""The load generator's reply check and config, without a server."""

from __future__ import annotations

import math

import pytest

from loadtest import report
from loadtest.checks import BadReply, check_reply
from loadtest.config import LoadConfig
from loadtest.run import parse_args
from recsys_stack.config import ConfigError
from serving.stubs import ranker_pb2


def _reply(scores: list[float], name: str = "dlrm", version: str = "1") -> ranker_pb2.ScoreResponse:
    return ranker_pb2.ScoreResponse(scores=scores, model_name=name, model_version=version)


@pytest.mark.parametrize(
    ("scores", "name", "version", "reason"),
    [
        ([0.1, 0.9, 0.5], "dlrm", "1", None),
        ([0.1, 0.9], "dlrm", "1", "2 scores for 3 examples"),
        ([], "dlrm", "1", "0 scores for 3 examples"),
        ([0.1, math.nan, 0.5], "dlrm", "1", "not a probability"),
        ([0.1, 1.5, 0.5], "dlrm", "1", "not a probability"),
        ([0.1, -0.01, 0.5], "dlrm", "1", "not a probability"),
        ([0.1, 0.2, 0.3], "", "1", "no model name"),
        ([0.1, 0.2, 0.3], "dlrm", "", "no model name or version"),
    ],
)
def test_a_reply_is_a_success_only_when_it_can_be_right(
    scores: list[float], name: str, version: str, reason: str | None
) -> None:
    request = ranker_pb2.ScoreRequest(num_examples=3)
    bad = check_reply(request, _reply(scores, name, version))
    if reason is None:
        assert bad is None
    else:
        assert isinstance(bad, BadReply) and reason in str(bad)
        assert report._failure_type(repr(bad)) == "BAD_REPLY"


def test_load_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="did you mean 'users'"):
        parse_args(["usres=3"])
    with pytest.raises(ConfigError, match="step_users needs slo_p99_ms"):
        parse_args(["--step-users", "1,2"])
    with pytest.raises(ConfigError, match="duration"):
        parse_args(["--duration", "soon"])
    cfg = parse_args(["--step-users", "1,2,4", "--slo-p99-ms", "50", "--users", "3"])
    assert (cfg.step_users, cfg.slo_p99_ms, cfg.users) == ([1, 2, 4], 50.0, 3)
    assert parse_args(["--step-users", "[1, 2]", "slo_p99_ms=5"]).step_users == [1, 2]
    # failed calls fail a run unless told otherwise
    assert parse_args([]).slo_failure_ratio == 0.01
    assert parse_args(["--slo-failure-ratio", "1"]).slo_failure_ratio == 1.0
    with pytest.raises(ConfigError, match=r"slo_failure_ratio = 1\.5: must be in"):
        parse_args(["--slo-failure-ratio", "1.5"])
    with pytest.raises(ConfigError, match="sample_rows = 50 < examples = 100: "):
        parse_args(["--sample-rows", "50"])


def test_gateway_address_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECSYS_GATEWAY", "10.0.0.1:6000")
    assert parse_args([]).host == "10.0.0.1:6000"
    assert parse_args(["--host", "h:1"]).host == "h:1"  # the command line wins
    assert LoadConfig().host == "127.0.0.1:50051"  # the class default does not read it
