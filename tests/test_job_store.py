"""The API's job store on both of its databases: SQLite (a file, one API process) and PostgreSQL (shared by
several), each a real server or file; two stores on one database stand for two API processes."""

import sqlite3
import time

import numpy as np
import pytest

from machgen.api.database import SCHEMA_VERSION, Database
from machgen.api.keys import StoredKeyRing, add_stored_key
from machgen.api.store import Job, JobStore, pack_inputs, unpack_inputs


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path):
    """The target two API processes share: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return tmp_path / "jobs.sqlite3"
    return request.getfixturevalue("postgres_server").database()


def stores(database, tmp_path, count=2):
    return [JobStore(tmp_path / f"data-{index}", database) for index in range(count)]


def test_jobs_list_newest_first_page_and_keep_results(database, tmp_path):
    store, = stores(database, tmp_path, 1)
    jobs = [store.insert(Job(f"img_{i}", "image", "flux", "alice", {"prompt": str(i)})) for i in range(3)]
    assert [job.id for job in store.list()] == ["img_2", "img_1", "img_0"]
    assert [job.id for job in store.list(after="img_2", limit=1)] == ["img_1"]
    assert [job.id for job in store.list(ascending=True, after="img_0")] == ["img_1", "img_2"]
    assert store.active_count("alice") == 3 and store.active_count("bob") == 0
    jobs[0].status, jobs[0].outputs, jobs[0].expires_at = "completed", ["image-0.png"], int(time.time()) - 1
    store.write_results("img_0", {"image-0.png": b"\x89PNG-0"})
    assert store.finish(jobs[0], None)
    assert store.read_result("img_0", "image-0.png") == b"\x89PNG-0"
    assert store.get("img_0").status == "completed" and store.active_count("alice") == 2
    assert store.expire() == ["img_0"] and store.read_result("img_0", "image-0.png") is None
    assert store.get("img_0").outputs == []
    store.delete("img_1")
    assert store.get("img_1") is None and store.counts() == {"completed": 1, "queued": 1}


def test_an_idempotency_key_gives_back_its_owners_job(database, tmp_path):
    store, other = stores(database, tmp_path)
    first = store.insert(Job("img_a", "image", "flux", "alice", {}, idempotency_key="k"))
    assert other.insert(Job("img_b", "image", "flux", "alice", {}, idempotency_key="k")).id == first.id
    assert other.insert(Job("img_c", "image", "flux", "bob", {}, idempotency_key="k")).id == "img_c"


def test_a_job_whose_lease_ran_out_is_taken_over_once_with_its_inputs_and_its_holder_is_fenced(database, tmp_path):
    first, second, third = stores(database, tmp_path, 3)
    variants = [{"prompt": "a red cat", "seed": 5, "image": np.arange(12, dtype=np.uint8).reshape(2, 2, 3)},
                {"prompt": "a red cat", "seed": 6, "lora": ["orange"], "lora_scale": [0.5]}]
    job = first.insert(Job("img_x", "image", "flux", "alice", {"n": 2}), pack_inputs(variants), lease_s=0.3)
    held, cancel = first.renew({"img_x": ("in_progress", 40)}, lease_s=0.3)
    assert held == {"img_x"} and cancel == set() and second.get("img_x").progress == 40
    assert second.take_over(lease_s=30) is None  # its holder renews it
    time.sleep(0.4)  # the holder was killed: no renewal
    taken, inputs = second.take_over(lease_s=30)
    assert taken.id == "img_x" and taken.status == "queued" and third.take_over(lease_s=30) is None
    again = unpack_inputs(inputs)
    assert again[0]["image"].tolist() == variants[0]["image"].tolist() and again[1] == variants[1]
    # The first holder comes back: it holds nothing and records nothing.
    assert first.renew({"img_x": ("in_progress", 90)}, lease_s=30) == (set(), set())
    job.status = "completed"
    assert not first.finish(job, ("http://example.com/hook", "image.completed", {"id": "img_x"}))
    assert not first.update(job)
    second.request_cancel("img_x")
    assert second.renew({"img_x": ("in_progress", 10)}, lease_s=30) == ({"img_x"}, {"img_x"})
    taken.status = "cancelled"
    assert second.finish(taken, None) and third.get("img_x").status == "cancelled"
    assert first.claim_webhook(lease_s=30) is None  # the fenced finish queued no webhook


def test_an_owners_jobs_take_turns_in_order_under_its_running_cap_across_processes(database, tmp_path):
    """At most ``cap`` of an owner's jobs have their turn at once, in every process; the owner's oldest waiting
    job goes next; other owners are not held back; a job taken over waits its turn again."""
    import threading

    first, second = stores(database, tmp_path)
    alice = [(first if index % 2 == 0 else second).insert(
        Job(f"img_a{index}", "image", "flux", "alice", {}), pack_inputs([{}]), lease_s=0.3) for index in range(4)]
    bob = first.insert(Job("img_b0", "image", "flux", "bob", {}))
    assert not second.admit("img_a1", "alice", 2)  # img_a0 came first and still waits
    assert first.admit("img_a0", "alice", 2) and second.admit("img_a1", "alice", 2)
    assert not first.admit("img_a2", "alice", 2)  # two of alice's run
    assert first.admit("img_b0", "bob", 2)  # bob's own turns
    alice[0].status = "completed"
    assert first.finish(alice[0], None)
    assert not second.admit("img_a3", "alice", 2) and first.admit("img_a2", "alice", 2)
    # img_a1's process was killed: taken over, it waits for its turn again, still before img_a3
    time.sleep(0.4)
    first.renew({"img_a2": ("in_progress", 10)}, lease_s=30)
    second.renew({"img_a3": ("queued", 0)}, lease_s=30)
    taken, _ = first.take_over(lease_s=30)
    assert taken.id == "img_a1" and first.take_over(lease_s=30) is None
    assert not second.admit("img_a3", "alice", 2) and first.admit("img_a1", "alice", 2)
    assert not second.admit("img_a3", "alice", 2)  # a1 and a2 run
    assert second.admit("img_a3", "alice", None) and first.admit(bob.id, "bob", None)  # no cap: at once

    # Eight of carol's jobs on two processes, each asking again and again from its own thread: three at once.
    for index in range(8):
        (first if index % 2 else second).insert(Job(f"img_c{index}", "image", "flux", "carol", {}))
    admitted, stop = [], threading.Event()

    def ask(store, job_id):
        while not stop.is_set():
            if store.admit(job_id, "carol", 3):
                admitted.append(job_id)
                return
            time.sleep(0.01)

    threads = [threading.Thread(target=ask, args=(first if index % 2 else second, f"img_c{index}"))
               for index in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    stop.set()
    for thread in threads:
        thread.join()
    assert sorted(admitted) == ["img_c0", "img_c1", "img_c2"]


def test_a_webhook_is_claimed_by_one_process_at_a_time_until_delivered(database, tmp_path):
    first, second = stores(database, tmp_path)
    job = first.insert(Job("img_w", "image", "flux", "alice", {}))
    job.status = "completed"
    assert first.finish(job, ("http://example.com/hook", "image.completed", {"id": "img_w"}))
    claimed = second.claim_webhook(lease_s=30)
    assert claimed is not None and b'"image.completed"' in claimed.body and claimed.attempts == 0
    assert first.claim_webhook(lease_s=30) is None
    second.webhook_attempted(claimed, delivered=False, problem="HTTP 500", retry_at=time.time())
    retried = first.claim_webhook(lease_s=30)
    assert (retried.message_id, retried.attempts) == (claimed.message_id, 1)  # one id for every attempt
    first.webhook_attempted(retried, delivered=True, problem=None, retry_at=None)
    assert first.claim_webhook(lease_s=30) is None and second.claim_webhook(lease_s=30) is None
    assert first.next_webhook_at() is None


def test_a_listener_elsewhere_reads_a_jobs_events_with_only_the_latest_preview(database, tmp_path):
    writer, reader = stores(database, tmp_path)
    writer.add_event("img_e", "progress", {"step": 1}, 0)
    writer.add_event("img_e", "preview", {"step": 1, "image": "a"}, 0)
    writer.add_event("img_e", "preview", {"step": 2, "image": "b"}, 0)
    writer.add_event("img_e", "preview", {"step": 2, "image": "c"}, 1)
    events = reader.events_after("img_e", 0)
    assert [(event, data) for _, event, data in events] == [
        ("progress", {"step": 1}), ("preview", {"step": 2, "image": "b"}), ("preview", {"step": 2, "image": "c"})]
    assert reader.events_after("img_e", events[-1][0]) == []


def test_keys_kept_in_the_database_reach_every_process(database, tmp_path):
    first, second = stores(database, tmp_path)
    ring = StoredKeyRing(second, refresh_s=0.0)
    assert not ring.required  # no key yet: none needed
    key = add_stored_key(first, "agent", max_jobs=3)
    assert ring.required and ring.find(key).name == "agent" and ring.find(key).max_jobs == 3
    assert ring.find("mg-nope") is None
    with pytest.raises(ValueError, match="already has a key named 'agent'"):
        add_stored_key(second, "agent")
    assert first.setting("url_signing_key", lambda: "one") == second.setting("url_signing_key", lambda: "two")


def test_a_database_of_the_first_schema_is_migrated_and_keeps_its_jobs(tmp_path):
    """A jobs.sqlite3 written before schema versions (the first schema, as it shipped)."""
    path = tmp_path / "jobs.sqlite3"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE jobs (id TEXT PRIMARY KEY, kind TEXT NOT NULL, model TEXT NOT NULL, status TEXT NOT NULL,
            progress INTEGER NOT NULL, owner TEXT NOT NULL, idempotency_key TEXT, created_at INTEGER NOT NULL,
            completed_at INTEGER, expires_at INTEGER, request TEXT NOT NULL, outputs TEXT NOT NULL,
            stats TEXT NOT NULL, error TEXT);
        CREATE UNIQUE INDEX jobs_idempotency ON jobs (owner, idempotency_key) WHERE idempotency_key IS NOT NULL;
        INSERT INTO jobs VALUES ('img_old', 'image', 'flux', 'completed', 100, 'alice', NULL, 1, 2, NULL,
            '{"prompt": "old"}', '["image-0.png"]', '[{}]', NULL);
    """)
    old.close()
    store = JobStore(tmp_path, path)
    assert store.get("img_old").request == {"prompt": "old"}
    assert store.db.execute("SELECT version FROM schema_version") == [(SCHEMA_VERSION,)]
    store.insert(Job("img_new", "image", "flux", "alice", {}))
    assert [job.id for job in store.list()] == ["img_new", "img_old"]
    store.db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    store.close()
    with pytest.raises(RuntimeError, match="newer than this machgen"):
        Database(path)


def test_processes_starting_together_migrate_a_new_postgresql_database_once(postgres_server):
    import threading

    url = postgres_server.database()
    errors, versions = [], []

    def start():
        try:
            versions.append(Database(url).migrate())
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and versions == [SCHEMA_VERSION] * 4
