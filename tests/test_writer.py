"""kube/writer.py's Writer: who writes is one rule for both controllers (issue 45).

``write_mode`` says what a replica does with its plans' writes; the Writer asks it again
before every request, so no write leaves a standby or a dry run whatever a controller
does (a Services plan that loses the Lease halfway, an upgrade pass's evictions)."""

from __future__ import annotations

from typing import Any

import pytest

from shared_svc.kube.writer import NotWriting, Writer, write_mode


def test_the_leader_writes_dry_run_shows_a_standby_plans() -> None:
    assert write_mode(leader=True, dry_run=False) == "write"
    assert write_mode(leader=True, dry_run=True) == "dry-run"
    # A standby plans only, dry-run or not: the leader alone shows what it would write.
    assert write_mode(leader=False, dry_run=False) == "standby"
    assert write_mode(leader=False, dry_run=True) == "standby"


class Bucket:
    """A token bucket that hands its token at once and may take the Lease away meanwhile."""

    def __init__(self, lose: list[bool] | None = None) -> None:
        self.taken = 0
        self._lose = lose

    async def take(self) -> None:
        self.taken += 1
        if self._lose is not None:
            self._lose[0] = False  # the Lease lost while the write waited for its token


def writer(*, leader: list[bool], dry_run: bool = False, bucket: Bucket | None = None) -> Writer:
    # No API client: a write that got through would fail on it, not be refused.
    api: Any = None
    return Writer(api, bucket=bucket or Bucket(), dry_run=dry_run, is_leader=lambda: leader[0])  # type: ignore[arg-type]


@pytest.mark.parametrize(("leader", "dry_run"), [(False, False), (True, True), (False, True)])
async def test_a_write_not_the_leaders_to_send_is_refused_and_not_counted(
    leader: bool, dry_run: bool
) -> None:
    w = writer(leader=[leader], dry_run=dry_run)
    with pytest.raises(NotWriting, match=r"refused: (standby|dry-run)"):
        await w.apply({"kind": "Service", "metadata": {"namespace": "ns", "name": "a"}})
    with pytest.raises(NotWriting):
        await w.delete_at("/api/v1/namespaces/ns/pods/p", {"uid": "u"})
    with pytest.raises(NotWriting):
        await w.send("evict", "POST", "/api/v1/namespaces/ns/pods/p/eviction", body={})
    assert w.writes == {}


async def test_the_lease_lost_while_a_write_waits_for_its_token_refuses_it() -> None:
    leader = [True]
    bucket = Bucket(lose=leader)
    w = writer(leader=leader, bucket=bucket)
    with pytest.raises(NotWriting, match="standby"):
        await w.json_patch("Service", "ns", "a", [])
    assert bucket.taken == 1 and w.writes == {}
