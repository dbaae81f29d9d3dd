"""The session's state driven call by call, without threads: ids in flight, lanes, cancel,
acks, shutdown and the end."""

from __future__ import annotations

import pytest

from protocol.errors import ErrorKind, RpcError
from protocol.methods import CacheRefParams, GenerateParams, LoadParams, NoParams, PrefillParams, TokenizeParams
from worker.session import Session


def receive(session: Session, request_id, method: str, params=None):
    """A request as the dispatcher hands it over: its lane and rules come from worker/policy.py."""
    return session.receive(request_id, method, params or NoParams(), now=0.0)


def test_an_id_in_flight_is_refused_and_free_again_once_answered():
    session = Session(max_batch=8)
    job = receive(session, 1, "generate", GenerateParams(prompt="a"))
    with pytest.raises(RpcError) as refused:
        receive(session, 1, "tokenize", TokenizeParams(text="a"))
    assert refused.value.kind is ErrorKind.DUPLICATE_ID
    assert session.next_model_job() is job
    session.release(job)
    assert receive(session, 1, "tokenize", TokenizeParams(text="a")) is not None


def test_quick_requests_are_answered_inline_unless_something_they_must_see_is_ahead():
    session = Session(max_batch=8)
    assert receive(session, 1, "capabilities") is None
    assert receive(session, 2, "cache/list") is None
    text = receive(session, 3, "tokenize", TokenizeParams(text="a"))
    assert text.text_lane and session.next_text_job() is text
    receive(session, 4, "prefill", PrefillParams(prompt="a", cache="x"))
    listing = receive(session, 5, "cache/info", CacheRefParams(cache="x"))
    assert listing is not None and not listing.text_lane, "cache/* behind a prefill waits on the model lane"


def test_cache_requests_wait_only_behind_requests_that_use_a_cache():
    session = Session(max_batch=8)
    receive(session, 1, "generate", GenerateParams(prompt="a"))
    assert receive(session, 2, "cache/list") is None, "a generate without a cache does not hold cache/*"
    receive(session, 3, "generate", GenerateParams(prompt="a", cache="auto"))
    listing = receive(session, 4, "cache/list")
    assert listing is not None and not listing.text_lane
    deleting = receive(session, 5, "cache/delete", CacheRefParams(cache="x"))
    assert deleting is not None, "queued behind the listing received before it"


def test_a_cancelled_shutdown_keeps_its_place_and_a_cancelled_prefill_is_withdrawn():
    session = Session(max_batch=8)
    load = receive(session, 1, "load", LoadParams())
    assert session.next_model_job() is load
    prefill = receive(session, 2, "prefill", PrefillParams(prompt="a", cache="x"))
    shutdown = receive(session, 3, "shutdown")
    assert prefill.is_cancelled(), "shutdown cancels what is in flight"
    assert session.take_withdrawn() == [prefill], "queued: withdrawn, for the reader to answer at once"
    session.cancel(3)
    assert session.take_withdrawn() == [] and session.next_model_job() is None, "the shutdown keeps its place"
    session.release(prefill)
    assert session.next_model_job() is None, "the shutdown waits for the load, though cancelled"
    session.release(load)
    assert session.next_model_job() is shutdown


def test_text_requests_behind_a_load_run_on_the_model_lane_after_it():
    session = Session(max_batch=8)
    load = receive(session, 1, "load", LoadParams())
    tokenize = receive(session, 2, "tokenize", TokenizeParams(text="a"))
    assert not tokenize.text_lane and session.next_text_job() is None
    assert session.next_model_job() is load
    assert session.next_model_job() is None, "nothing starts beside a load"
    session.release(load)
    assert session.next_model_job() is tokenize


def test_a_load_starts_only_after_the_text_requests_received_before_it():
    session = Session(max_batch=8)
    tokenize = receive(session, 1, "tokenize", TokenizeParams(text="a"))
    load = receive(session, 2, "load", LoadParams())
    assert session.next_model_job() is None
    assert session.next_text_job() is tokenize
    assert session.next_model_job() is None, "the tokenize is running, not answered"
    session.release(tokenize)
    assert session.next_model_job() is load and load.running


def test_cancel_reports_where_the_request_was():
    session = Session(max_batch=1)
    running = receive(session, 1, "generate", GenerateParams(prompt="a"))
    queued = receive(session, 2, "generate", GenerateParams(prompt="b"))
    assert session.next_model_job() is running
    assert session.cancel(1).state == "running" and session.cancel(1).cancelled
    assert session.cancel(2).state == "queued" and queued.is_cancelled()
    assert session.cancel(3).state == "unknown" and not session.cancel(3).cancelled
    assert session.take_withdrawn() == [queued], "a cancelled queued request is withdrawn, to answer at once"
    assert session.next_model_job() is None and session.cancel(2).state == "queued", "in flight until answered"
    assert session.take_withdrawn() == [], "withdrawn once"
    session.release(queued)
    assert session.cancel(2).state == "unknown"


@pytest.mark.parametrize("lane", ["model", "text", "starting"])
def test_a_queued_request_cancelled_while_a_load_runs_is_withdrawn_from_its_queue(lane: str):
    session = Session(max_batch=8)
    if lane == "text":  # on the text lane behind a running tokenize
        ahead = receive(session, 1, "tokenize", TokenizeParams(text="a"))
        assert session.next_text_job() is ahead
        queued = receive(session, 2, "tokenize", TokenizeParams(text="b"))
    elif lane == "model":  # behind a running load
        ahead = receive(session, 1, "load", LoadParams())
        assert session.next_model_job() is ahead
        queued = receive(session, 2, "generate", GenerateParams(prompt="b"))
    else:  # a load taken off the queue, waiting for a text request received before it
        ahead = receive(session, 1, "tokenize", TokenizeParams(text="a"))
        queued = receive(session, 2, "load", LoadParams())
        assert session.next_model_job() is None and session.next_text_job() is ahead
    assert session.cancel(2).state == "queued" and session.take_withdrawn() == [queued]
    assert session.next_text_job() is None and session.next_model_job() is None, "no lane runs it"
    session.release(queued)
    session.release(ahead)
    assert session.jobs == {} and session.admission.idle


def test_a_running_load_cannot_be_cancelled_halfway():
    session = Session(max_batch=8)
    receive(session, 1, "load", LoadParams())
    session.next_model_job()
    result = session.cancel(1)
    assert (result.cancelled, result.state) == (False, "running")


def test_acks_only_move_forward_and_are_ignored_for_ended_streams():
    session = Session(max_batch=8)
    job = receive(session, 1, "generate", GenerateParams(prompt="a"))
    session.ack(1, 4)
    session.ack(1, 2)
    assert job.acked == 4
    session.release(session.next_model_job())
    session.ack(1, 9)  # no error, nothing to update


def test_shutdown_cancels_what_is_in_flight_refuses_what_follows_and_starts_last():
    session = Session(max_batch=8)
    generate = receive(session, 1, "generate", GenerateParams(prompt="a"))
    text = receive(session, 2, "detokenize")
    shutdown = receive(session, 3, "shutdown")
    assert generate.is_cancelled() and text.is_cancelled() and not shutdown.is_cancelled()
    with pytest.raises(RpcError) as refused:
        receive(session, 4, "capabilities")
    assert refused.value.kind is ErrorKind.SHUTTING_DOWN
    assert session.take_withdrawn() == [generate, text]  # cancelled while queued: answered at once
    assert session.next_model_job() is None and session.next_text_job() is None
    session.release(generate)
    assert session.next_model_job() is None, "shutdown waits for the text request received before it"
    session.release(text)
    assert session.next_model_job() is shutdown


def test_the_end_cancels_or_drains_and_the_lanes_finish_their_queues():
    session = Session(max_batch=8)
    job = receive(session, 1, "generate", GenerateParams(prompt="a"))
    assert session.end(cancel=False) and not job.is_cancelled()
    assert not session.model_lane_done and session.text_lane_done
    assert not session.end(cancel=True) and job.is_cancelled()
    session.release(session.next_model_job())
    assert session.model_lane_done
