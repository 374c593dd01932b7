"""The router's token check off the event loop: a slow metadata database must not stall the other
requests a replica is serving (they share one asyncio loop)."""

import asyncio
import time

from starlette.requests import Request

from raypai.serving.auth import TokenCheck
from raypai.store import MetadataStore


class SlowStore(MetadataStore):
    """The real SQLite store behind a slow network: each token lookup takes 0.5 s more."""

    def lookup_token(self, token):
        time.sleep(0.5)
        return super().lookup_token(token)


def _request(token: str) -> Request:
    return Request({"type": "http", "headers": [(b"authorization", f"Bearer {token}".encode())]})


def test_a_token_lookup_does_not_block_the_event_loop(tmp_path):
    store = SlowStore(f"sqlite:///{tmp_path}/meta.db")
    token = store.create_token("client", ["infer"])
    check = TokenCheck(store, ttl_s=60.0)

    async def main():
        ticks = 0

        async def ticker():  # stands for the replica's other requests
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        name = await check.check(_request(token), "infer")  # cache miss: 0.5 s in the database
        during_lookup = ticks
        again = await check.check(_request(token), "infer")  # cached: no database call
        t.cancel()
        return name, again, during_lookup

    name, again, during_lookup = asyncio.run(main())
    assert name == again == "client"
    assert during_lookup >= 5, f"the event loop ran only {during_lookup} ticks during a 0.5 s lookup"


def test_unknown_and_wrong_scope_tokens_are_refused(tmp_path):
    import pytest

    from raypai.serving.errors import APIError

    store = MetadataStore(f"sqlite:///{tmp_path}/meta.db")
    token = store.create_token("deployer", ["deploy"])
    check = TokenCheck(store, ttl_s=60.0)
    with pytest.raises(APIError) as err:
        asyncio.run(check.check(_request("nope"), "infer"))
    assert err.value.status_code == 401
    with pytest.raises(APIError) as err:
        asyncio.run(check.check(_request(token), "infer"))
    assert err.value.status_code == 403 and "'infer'" in err.value.detail


class DownStore(MetadataStore):
    """The real SQLite store whose server stops answering when `down` is set; counts the lookups tried."""

    down, tries = False, 0

    def lookup_token(self, token):
        self.tries += 1
        if self.down:
            from sqlalchemy.exc import OperationalError

            raise OperationalError("SELECT", {}, ConnectionRefusedError("db.internal:5432 refused"))
        return super().lookup_token(token)


def test_an_outage_keeps_known_tokens_backs_off_and_a_revocation_lands_once_it_answers(tmp_path):
    """Lifetime 0.2 s. Down: a token seen before keeps its last answer (even past its lifetime), one never
    seen gets 503; after a failed lookup the database is not asked again for 1 s (back-off), so a burst
    of requests costs one failed round trip. Up again: a token revoked meanwhile is refused."""
    import pytest

    from raypai.serving.errors import APIError

    store = DownStore(f"sqlite:///{tmp_path}/meta.db")
    known, unseen = store.create_token("known", ["infer"]), store.create_token("unseen", ["infer"])
    check = TokenCheck(store, ttl_s=0.2)
    assert asyncio.run(check.check(_request(known), "infer")) == "known"
    store.down = True
    time.sleep(0.3)  # past the lifetime: the next check asks the database, which fails
    tries = store.tries
    for _ in range(5):
        assert asyncio.run(check.check(_request(known), "infer")) == "known"
    assert store.tries == tries + 1  # one failed lookup, then the back-off
    with pytest.raises(APIError) as err:
        asyncio.run(check.check(_request(unseen), "infer"))
    assert err.value.status_code == 503 and "db.internal" not in err.value.detail
    store.revoke_token("known")  # written while the check cannot read (as another process would)
    store.down = False
    time.sleep(1.1)  # the back-off ends
    with pytest.raises(APIError) as err:
        asyncio.run(check.check(_request(known), "infer"))
    assert err.value.status_code == 401
