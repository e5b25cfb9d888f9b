"""Webhooks as the Standard Webhooks specification signs them: a POST of
JSON with ``webhook-id``, ``webhook-timestamp`` and ``webhook-signature``
(``v1,`` base64 HMAC-SHA256 of ``id.timestamp.body`` under the secret's key),
retried with exponential backoff and jitter until the receiver answers 2xx.

The secret is ``whsec_`` + base64 of the key bytes (what ``standardwebhooks``
and the receivers built on it take); ``new_secret()`` makes one.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import random
import secrets
import time
from dataclasses import dataclass
from typing import Any

from machgen.api.destinations import DestinationPolicy, RefusedDestination

SECRET_PREFIX = "whsec_"
log = logging.getLogger("machgen.api.webhooks")


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def secret_key(secret: str) -> bytes:
    try:
        return base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    except ValueError as err:
        raise ValueError("a webhook secret is 'whsec_' followed by base64") from err


def signed_headers(secret: str, message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    content = f"{message_id}.{timestamp}.".encode() + body
    signature = base64.b64encode(hmac.new(secret_key(secret), content, hashlib.sha256).digest()).decode()
    return {"webhook-id": message_id, "webhook-timestamp": str(timestamp), "webhook-signature": f"v1,{signature}",
            "content-type": "application/json"}


@dataclass(frozen=True)
class WebhookPolicy:
    """How deliveries are retried: ``attempts`` in all, waiting ``first_delay_s``
    x 2^k (plus up to half of it again at random) before retry k + 1."""

    secret: str
    attempts: int = 6
    first_delay_s: float = 1.0
    timeout_s: float = 10.0


class WebhookSender:
    """Delivers the store's webhook outbox in the background. A delivery is
    queued with the job's end in one transaction, then claimed by one API
    process at a time (on PostgreSQL, whichever is free): sent once, and
    kept across a restart or a killed process until it is delivered or its
    attempts run out. Every attempt of one delivery carries the same
    ``webhook-id``, so a receiver can tell a retry from a new event."""

    def __init__(self, policy: WebhookPolicy | None, store, destinations: DestinationPolicy | None = None,
                 concurrency: int = 8):
        self.policy = policy
        self.store = store
        self.destinations = destinations or DestinationPolicy()
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task] = set()

    def send(self, url: str, event_type: str, data: dict[str, Any]) -> None:
        if self.policy is None:
            log.warning("job asked for a webhook to %s but the API has no webhook secret: not sent", url)
            return
        self.store.queue_webhook(url, event_type, data)
        self._wake.set()

    def queued(self) -> None:
        """A delivery was queued with a job's end (store.finish): look at the outbox now."""
        self._wake.set()

    async def run(self) -> None:
        """Claim and send due deliveries until cancelled."""
        if self.policy is None:
            return
        lease_s = 2 * self.policy.timeout_s + 5
        while True:
            await self._slots.acquire()
            try:
                webhook = await asyncio.to_thread(self.store.claim_webhook, lease_s)
            except Exception:  # noqa: BLE001 - the database away for a moment: try again, never stop delivering
                log.exception("webhook outbox: could not claim a delivery")
                webhook = None
            if webhook is None:
                self._slots.release()
                await self._idle()
                continue
            task = asyncio.get_running_loop().create_task(self._attempt(webhook))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(lambda _: self._slots.release())

    async def _idle(self) -> None:
        """Until a delivery is queued here or the next retry is due; on a shared database at most a second
        (other processes queue deliveries too)."""
        self._wake.clear()
        next_at = await asyncio.to_thread(self.store.next_webhook_at)
        wait = 60.0 if next_at is None else max(next_at - time.time(), 0.05)
        if self.store.shared:
            wait = min(wait, 1.0)
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=wait)
        except asyncio.TimeoutError:
            pass

    async def _attempt(self, webhook) -> None:
        import httpx

        policy = self.policy
        # Signed anew each attempt: a receiver refuses old timestamps.
        headers = signed_headers(policy.secret, webhook.message_id, int(time.time()), webhook.body)
        problem, refused = None, False
        try:
            # Checked again now, and sent to the very address checked (a name may resolve elsewhere by now).
            destination = await asyncio.to_thread(self.destinations.check, webhook.url)
            headers["host"] = destination.host_header
            async with httpx.AsyncClient(timeout=policy.timeout_s) as client:
                response = await client.post(destination.connect_url, content=webhook.body, headers=headers,
                                             extensions={"sni_hostname": destination.host})
            if not 200 <= response.status_code < 300:
                problem = f"HTTP {response.status_code}"
        except RefusedDestination as err:
            problem, refused = f"refused: {err}", "does not resolve" not in str(err)
        except httpx.HTTPError as err:
            problem = f"{type(err).__name__}: {err}" or type(err).__name__
        retry_at = None
        if problem is not None and not refused and webhook.attempts + 1 < policy.attempts:
            delay = policy.first_delay_s * 2 ** webhook.attempts * (1 + random.random() / 2)
            retry_at = time.time() + delay
            log.info("webhook %s to %s: %s; retry in %.1f s", webhook.message_id, webhook.url, problem, delay)
        elif problem is not None:
            log.warning("webhook %s to %s: gave up after %d attempts (%s)", webhook.message_id, webhook.url,
                        policy.attempts, problem)
        await asyncio.to_thread(self.store.webhook_attempted, webhook, problem is None, problem, retry_at)

    async def drain(self, timeout_s: float = 5.0) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
