"""The sampler's step gate (runtime/scheduling.py): the decision as a pure function, and the gate under threads."""

import contextlib
import threading
import time

import pytest

from machgen.runtime.scheduling import (GateClosed, SchedulerState, SchedulingPolicy, StepGate, Waiter,
                                        next_turn)

POLICY = SchedulingPolicy(slots=1, batch_min_share=0.1, share_window_s=10.0)


def test_interactive_goes_before_batch_that_has_had_its_share():
    state = SchedulerState()
    state.charge("agent", "batch", 1.0, now=1.0, window_s=10.0)
    state.charge("person", "interactive", 1.0, now=1.0, window_s=10.0)  # batch has had half
    waiting = [Waiter("agent", "batch", 0), Waiter("agent", "batch", 1), Waiter("person", "interactive", 2)]
    assert next_turn(waiting, state, POLICY).owner == "person"


def test_batch_keeps_its_minimum_share_while_interactive_work_waits():
    state = SchedulerState()
    state.charge("person", "interactive", 9.5, now=1.0, window_s=10.0)
    state.charge("agent", "batch", 0.5, now=1.0, window_s=10.0)  # 5 % of the time: under its 10 %
    waiting = [Waiter("person", "interactive", 0), Waiter("agent", "batch", 1)]
    assert next_turn(waiting, state, POLICY).priority == "batch"
    state.charge("agent", "batch", 1.0, now=1.0, window_s=10.0)  # 14 %: over it
    assert next_turn(waiting, state, POLICY).priority == "interactive"


def test_within_a_priority_the_owner_served_least_goes_first_then_first_come():
    state = SchedulerState()
    state.charge("a", "batch", 3.0, now=1.0, window_s=10.0)
    state.charge("b", "batch", 1.0, now=1.0, window_s=10.0)
    waiting = [Waiter("a", "batch", 0), Waiter("b", "batch", 1), Waiter("b", "batch", 2)]
    assert next_turn(waiting, state, POLICY).arrival == 1
    assert next_turn([], state, POLICY) is None


def test_an_owner_back_from_idle_starts_at_the_least_served_active_owner():
    """VTC's lift: having had nothing to run earns no credit over those who kept the denoiser busy."""
    state = SchedulerState()
    state.charge("busy", "batch", 50.0, now=1.0, window_s=10.0)
    state.charge("other", "batch", 40.0, now=1.0, window_s=10.0)
    state.arrive("idle", "batch", [("batch", "busy"), ("batch", "other")])
    assert state.counters[("batch", "idle")] == 40.0
    state.arrive("idle", "interactive", [("batch", "busy")])  # no interactive owner active: as it was
    assert ("interactive", "idle") not in state.counters
    state.reset()
    assert state.counters == {} and state.share("batch") == 0.0


def test_recent_shares_decay_with_the_window():
    state = SchedulerState()
    state.charge("agent", "batch", 10.0, now=1.0, window_s=10.0)
    state.charge("person", "interactive", 10.0, now=31.0, window_s=10.0)  # three windows later
    assert state.share("batch") == pytest.approx(0.0474, abs=1e-3)


def _burst(gate, jobs, step_s=0.02):
    """Threads that each run a request of ``steps`` denoiser calls through ``gate``, as the served sampler runs
    them (its place in the order of arrival taken when it comes); the order in which calls ran."""
    order, threads = [], []
    lock = threading.Lock()
    start = threading.Barrier(len(jobs))

    def run(name, owner, priority, steps, delay):
        start.wait()  # every thread running before any call: arrivals as the jobs say
        time.sleep(delay)
        request = gate.request_order()
        for _ in range(steps):
            with gate.turn(owner, priority, order=request):
                with lock:
                    order.append(name)
                time.sleep(step_s)
        gate.leave(request)

    for job in jobs:
        threads.append(threading.Thread(target=run, args=job))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return order


def test_a_persons_request_overtakes_an_agents_burst_at_the_gate():
    gate = StepGate(SchedulingPolicy(slots=1, batch_min_share=0.1))
    jobs = [(f"agent-{i}", "agent", "batch", 5, 0.0) for i in range(8)] + [("person", "person", "interactive", 5, 0.1)]
    order = _burst(gate, jobs)
    last_person = max(i for i, name in enumerate(order) if name == "person")
    # Arriving after 0.1 s of a 0.8 s burst, the person's five steps are done within about 6 slots of arriving
    # (one batch turn for the minimum share), not after the 40 batch calls before it.
    first_person = order.index("person")
    assert last_person - first_person <= 6, order
    assert first_person < 10 and len(order) == 45


def test_a_freed_slot_wakes_only_the_call_it_goes_to():
    """An agent's burst waiting at the gate wakes one waiting call per freed slot, not every waiting call to look
    (40 waiting requests woke 40 threads on the sampler's one interpreter at every step). A waiting call wakes
    otherwise only on its quarter-second check for cancellation: ``is_cancelled`` counts its wake-ups."""
    gate = StepGate(SchedulingPolicy(slots=1))
    lock, wakeups, calls = threading.Lock(), [], []
    start = threading.Barrier(40)

    def woke() -> bool:
        with lock:
            wakeups.append(1)
        return False

    def run():
        start.wait()
        request = gate.request_order()
        for _ in range(5):
            with gate.turn("agent", "batch", is_cancelled=woke, order=request):
                calls.append(1)
                time.sleep(0.001)
        gate.leave(request)

    threads = [threading.Thread(target=run) for _ in range(40)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    checks = 40 * ((time.monotonic() - started) / 0.25 + 2)  # every call's checks, and a spare pair each
    assert len(calls) == 200 and len(wakeups) <= checks, (len(wakeups), checks)  # woken by each step: thousands


def test_owners_of_one_priority_share_the_denoiser_evenly():
    gate = StepGate(SchedulingPolicy(slots=1))
    jobs = [(f"a-{i}", "a", "batch", 4, 0.0) for i in range(6)] + [("b-0", "b", "batch", 8, 0.0)]
    order = _burst(gate, jobs, step_s=0.005)
    # b's one request gets half the turns, as a's six together (first come, first served: every seventh; its
    # last call would come about 50th).
    assert max(i for i, name in enumerate(order) if name == "b-0") < 20, order


def test_one_owners_requests_run_in_their_order_as_a_queue_runs_them():
    """With its request's order, a request keeps its slot from one call to the next until it leaves: an owner's
    second request waits for the first (no step of it runs) rather than sharing."""
    gate = StepGate(SchedulingPolicy(slots=1))
    order, lock = [], threading.Lock()
    first, second = gate.request_order(), gate.request_order()
    start = threading.Barrier(2)

    def run(name, request):
        start.wait()
        for _ in range(4):
            with gate.turn("alice", "interactive", order=request):
                with lock:
                    order.append(name)
                time.sleep(0.01)
        gate.leave(request)

    threads = [threading.Thread(target=run, args=("second", second)), threading.Thread(target=run, args=("first", first))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # The second may take the very first turn (it may arrive while no call of the first waits).
    assert "".join(name[0] for name in order) in ("ffffssss", "sffffsss"), order


def test_while_a_person_runs_batch_requests_hold_only_their_share_of_the_slots():
    """Four slots, six batch requests holding them; a person's request comes: once the calls begun before it are
    done, at most one batch call runs beside each of its calls (a tenth of four slots, rounded up)."""
    gate = StepGate(SchedulingPolicy(slots=4, batch_min_share=0.1))
    lock = threading.Lock()
    running = {"batch": 0, "interactive": 0}
    most_beside_person = []
    start = threading.Barrier(7)

    def run(priority, steps, delay):
        request = gate.request_order()
        start.wait()
        time.sleep(delay)
        for step in range(steps):
            with gate.turn(priority, priority, order=request):
                with lock:
                    running[priority] += 1
                time.sleep(0.01)
                with lock:
                    if priority == "interactive" and step > 0:  # its first call may meet calls begun before it
                        most_beside_person.append(running["batch"])
                    running[priority] -= 1
        gate.leave(request)

    threads = [threading.Thread(target=run, args=("batch", 30, 0.0)) for _ in range(6)]
    threads.append(threading.Thread(target=run, args=("interactive", 10, 0.05)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert most_beside_person and max(most_beside_person) <= 1, most_beside_person


@contextlib.contextmanager
def slot_held(gate: StepGate, owner: str, priority: str):
    """A call of ``owner`` in the gate's slot, on a thread, until the block ends."""
    entered, done = threading.Event(), threading.Event()

    def holder():
        with gate.turn(owner, priority):
            entered.set()
            done.wait(5)

    thread = threading.Thread(target=holder)
    thread.start()
    assert entered.wait(5)
    try:
        yield
    finally:
        done.set()
        thread.join(5)


def test_a_call_cancelled_while_it_waits_leaves_and_the_others_go_on():
    gate = StepGate(SchedulingPolicy(slots=1))
    cancelled = threading.Event()
    with slot_held(gate, "a", "interactive"):
        waiting_error = []

        def waiter():
            try:
                with gate.turn("b", "interactive", is_cancelled=cancelled.is_set):
                    pass
            except GateClosed as err:
                waiting_error.append(err)

        second = threading.Thread(target=waiter)
        second.start()
        time.sleep(0.1)
        assert gate.waiting() == 1
        cancelled.set()
        second.join(5)
        assert waiting_error and gate.waiting() == 0
    times = []
    with gate.turn("c", "batch", waited=times):
        pass
    assert len(times) == 1 and times[0][0] < 0.2


def test_an_unslotted_call_runs_beside_full_slots_and_is_charged_to_its_owner():
    """The interactive request that computes its steps in the sampler (ServingOptions.denoiser_nice) holds no
    slot: it runs at once while every slot is taken, and its owner is charged its time as a turn's would be."""
    gate = StepGate(SchedulingPolicy(slots=1))
    times = []
    with slot_held(gate, "agent", "batch"):
        with gate.unslotted("person", "interactive", waited=times):
            time.sleep(0.05)
    assert len(times) == 1 and times[0][0] < 0.01 and times[0][1] >= 0.05
    assert gate.state.counters[("interactive", "person")] >= 0.05 and gate.state.share("interactive") > 0


def test_the_served_sampler_runs_a_persons_steps_before_an_agents_burst(triton_server):
    """24 batch requests reach the streaming model together (three times its 8 in flight), then a person's of
    the same length: the person's ends while most of the burst still runs, and waited at the step gate far less
    than the burst's requests did. Each request on its own client (one stream per client)."""
    from machgen.client import MachgenClient

    from conftest import PIPELINE_NAME

    ended: dict[str, tuple[float, dict]] = {}
    start = threading.Barrier(25)

    def run(name, priority, owner, seed, delay):
        with MachgenClient(triton_server.grpc_url) as client:
            client.is_ready(PIPELINE_NAME)
            start.wait()
            time.sleep(delay)
            _, stats = client.generate_with_stats(PIPELINE_NAME, "a cat", on_progress=lambda progress: None,
                                                  seed=seed, num_inference_steps=60, width=64, height=32,
                                                  priority=priority, owner=owner)
        ended[name] = (time.monotonic(), stats)

    threads = [threading.Thread(target=run, args=(f"agent-{i}", "batch", "agent", i, 0.0)) for i in range(24)]
    threads.append(threading.Thread(target=run, args=("person", "interactive", "person", 100, 0.3)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert len(ended) == 25
    person_at, person = ended.pop("person")
    later = [name for name, (at, _) in ended.items() if at > person_at]
    # The agent's own requests run in their order, 8 at a time: first come, first served the person's would end
    # after all 24; here after the first 8 at most.
    assert len(later) >= 14, f"only {len(later)} of 24 batch requests were still running when the person's ended"
    waited = sorted(stats["waited_seconds"] for _, stats in ended.values())
    assert person["priority"] == "interactive" and person["waited_seconds"] < waited[len(waited) // 2]
    assert {stats["priority"] for _, stats in ended.values()} == {"batch"}
