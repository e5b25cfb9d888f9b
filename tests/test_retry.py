"""The client's retry policy: which failures it sends again, how long it waits, and the seed that makes a
second try give the same image."""

import random

import pytest

from machgen.client import NO_RETRY, GenerationError, MachgenClient, RetryPolicy, retryable


@pytest.mark.parametrize("status, message, again", [
    ("StatusCode.UNAVAILABLE", "Exceeds maximum queue size", True),
    ("StatusCode.UNAVAILABLE", "failed to connect to all addresses", True),
    ("503", "the server is stopping", True),
    ("StatusCode.INTERNAL", "Stub process 'flux_0_3' is not healthy.", True),
    # a stream HAProxy reset when the replica behind it died (tests/test_faults.py)
    ("StatusCode.UNKNOWN", "Stream removed (Data frame with END_STREAM flag received) (RST_STREAM (Received "
                           "RST_STREAM with error code 8))", True),
    # a request HAProxy sent to a replica just before a rolling restart drained it (tests/test_faults.py)
    ("StatusCode.NOT_FOUND", "Request for unknown model: 'flux' has no available versions", True),
    ("StatusCode.NOT_FOUND", "Request for unknown model: 'flx' is not found", False),
    ("StatusCode.INVALID_ARGUMENT", "invalid input 'height': 66 is not a multiple of 16", False),
    ("400", "invalid input 'seed': -1 is outside [0, 9223372036854775807]", False),
    ("StatusCode.CANCELLED", "cancelled after 3 of 28 steps", False),
    ("StatusCode.INTERNAL", "generation failed: boom", False),
])
def test_only_failures_of_the_server_are_sent_again(status, message, again):
    assert retryable(GenerationError(status, message)) is again


def test_waits_grow_exponentially_with_jitter_up_to_the_ceiling():
    policy = RetryPolicy(attempts=8, first_delay_s=0.5, max_delay_s=4.0)
    rng = random.Random(0)
    for retry, ceiling in enumerate([0.5, 1.0, 2.0, 4.0, 4.0, 4.0]):
        waits = [policy.delay(retry, rng) for _ in range(200)]
        assert ceiling / 2 <= min(waits) and max(waits) <= ceiling
        assert max(waits) - min(waits) > ceiling / 4  # jittered, not one fixed wait


def test_a_request_without_a_seed_is_given_one_when_it_may_be_sent_again():
    def seed_sent(client):
        (seed,) = [tensor for tensor in client._inputs("flux", "a cat", {"seed": None}) if tensor.name() == "seed"] or [None]
        return seed

    with MachgenClient("127.0.0.1:1") as retrying, MachgenClient("127.0.0.1:1", retry=NO_RETRY) as once:
        assert seed_sent(retrying) is not None
        assert seed_sent(once) is None  # the server draws one, as diffusers does without a generator
        given = [t for t in retrying._inputs("flux", "a cat", {"seed": 7}) if t.name() == "seed"]
        assert len(given) == 1


@pytest.mark.parametrize("protocol, progress", [("grpc", False), ("http", False), ("grpc", True)])
def test_a_server_that_does_not_answer_is_tried_again_then_reported_unavailable(protocol, progress):
    from conftest import free_port

    # The streamed request's tries come quickly on one channel: after the first failure the channel fails new
    # streams at once, often before the request is handed to the stream (tritonclient then refuses it and says
    # why only through the stream's callback).
    attempts = 12 if progress else 3
    retries = []
    policy = RetryPolicy(attempts=attempts, first_delay_s=0.001, max_delay_s=0.002)
    with MachgenClient(f"127.0.0.1:{free_port()}", protocol, retry=policy,
                       on_retry=lambda attempt, error, delay: retries.append(attempt)) as client:
        with pytest.raises(GenerationError) as failed:
            client.infer("flux", [client.make_input("prompt", "a cat")],
                         on_progress=(lambda report: None) if progress else None)
    assert retryable(failed.value) and retries == list(range(1, attempts))
