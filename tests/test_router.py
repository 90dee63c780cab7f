"""The router's session directory (gdn_server.router.Directory): rebuilds from the engines' lists
never lose a session created meanwhile, nor revive one closed meanwhile."""
from __future__ import annotations

from gdn_server.router import Directory


def test_a_rebuild_replaces_what_the_engines_no_longer_hold():
    d = Directory()
    d.add("a", 0, "alice")
    d.add("evicted", 1, "alice")
    d.begin_rebuild()
    d.finish_rebuild({"a": (0, "alice"), "restored": (1, None)})
    assert (d.position_of("a"), d.position_of("restored"), d.position_of("never")) == (0, 1, None)
    assert d.owned_by("alice") == 1 and d.owned_by(None) == 1 and len(d) == 2
    # an evicted session no longer counts, but still routes to its engine, which says why it is gone
    assert d.position_of("evicted") == 1


def test_changes_while_a_rebuild_waits_survive_it():
    d = Directory()
    d.add("closed", 0, None)
    d.begin_rebuild()  # the lists below were taken before these changes
    d.add("created", 1, "bob")
    d.drop("closed")
    d.finish_rebuild({"closed": (0, None)})
    assert d.position_of("created") == 1 and d.position_of("closed") is None
    d.begin_rebuild()  # and once no rebuild waits, nothing is remembered any more
    d.finish_rebuild({})
    assert len(d) == 0


def test_overlapping_rebuilds_and_an_abandoned_one():
    d = Directory()
    d.begin_rebuild()
    d.begin_rebuild()
    d.add("x", 0, None)
    d.finish_rebuild({})  # the first to finish keeps x: the other rebuild still waits
    d.abandon_rebuild()
    assert d.position_of("x") == 0
