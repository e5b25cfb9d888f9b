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
import json
import logging
import random
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

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
    """Delivers events in the background."""

    def __init__(self, policy: WebhookPolicy | None):
        self.policy = policy
        self._tasks: set[asyncio.Task] = set()

    def send(self, url: str, event_type: str, data: dict[str, Any]) -> None:
        if self.policy is None:
            log.warning("job asked for a webhook to %s but the API has no webhook secret: not sent", url)
            return
        task = asyncio.get_running_loop().create_task(self._deliver(url, event_type, data))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver(self, url: str, event_type: str, data: dict[str, Any]) -> bool:
        import httpx

        policy = self.policy
        message_id = f"msg_{uuid.uuid4().hex}"
        body = json.dumps({"type": event_type, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "data": data}).encode()
        async with httpx.AsyncClient(timeout=policy.timeout_s) as client:
            for attempt in range(policy.attempts):
                # Signed anew each attempt: a receiver refuses old timestamps.
                headers = signed_headers(policy.secret, message_id, int(time.time()), body)
                try:
                    response = await client.post(url, content=body, headers=headers)
                    if 200 <= response.status_code < 300:
                        return True
                    problem = f"HTTP {response.status_code}"
                except httpx.HTTPError as err:
                    problem = f"{type(err).__name__}: {err}"
                if attempt + 1 < policy.attempts:
                    delay = policy.first_delay_s * 2 ** attempt
                    log.info("webhook %s to %s: %s; retry in %.1f s", message_id, url, problem, delay)
                    await asyncio.sleep(delay * (1 + random.random() / 2))
        log.warning("webhook %s to %s: gave up after %d attempts (%s)", message_id, url, policy.attempts, problem)
        return False

    async def drain(self, timeout_s: float = 5.0) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
