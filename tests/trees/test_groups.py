"""What makes a unit of training data (pipeline.trees.groups): whole groups, demonstration packs and their count."""

import msgspec

from pipeline.messages import GroupDropped, SamplingParams, TreeGroup
from pipeline.trees.groups import Grouper
from pipeline.trees.tree import TreeOptions
from tests.helpers.treegen import mc, settled


def rollout(rid, index, group="g0", size=2, purpose="train", demonstrations=0, temperature=1.0, version=0,
            status="ok"):
    s = settled([mc(0, [1, 2, 3], [10 + index])], rid=rid, index=index, group_size=size, status=status,
                reward=float(index), version=version)
    req = msgspec.structs.replace(s.request, group_id=group, purpose=purpose, demonstrations=demonstrations,
                                  sampling=SamplingParams(temperature=temperature))
    return msgspec.structs.replace(s, request=req)


def grouper(pack=2):
    return Grouper(TreeOptions, sft_pack=pack)


def test_a_group_goes_out_once_complete_with_its_temperature_and_oldest_version():
    g = grouper()
    assert g.add(rollout("a", 0, temperature=0.7, version=3)) is None
    assert g.incomplete_groups == 1
    done = g.add(rollout("b", 1, temperature=0.7, version=2))
    msg = done.message
    assert isinstance(msg, TreeGroup) and msg.purpose == "train" and msg.temperature == 0.7
    assert msg.issued_version == 2 and done.build is not None and g.incomplete_groups == 0


def test_a_dropped_group_keeps_its_purpose():
    g = grouper()
    g.add(rollout("a", 0, purpose="eval", status="sandbox_error"))
    done = g.add(rollout("b", 1, purpose="eval"))
    assert isinstance(done.message, GroupDropped) and done.message.purpose == "eval"


def test_demonstrations_pack_with_a_partial_last_pack_and_the_pack_count():
    g = grouper(pack=2)
    demos = [rollout(f"d{i}", 0, group=f"sft{i}", size=1, purpose="sft", demonstrations=5) for i in range(5)]
    out = [g.add(d) for d in demos]
    packs = [o.message for o in out if o is not None]
    assert [o is None for o in out] == [True, False, True, False, False]  # 2 + 2 + the last one alone
    assert [p.group_id for p in packs] == ["sftpack0000", "sftpack0001", "sftpack0002"]
    assert {p.packs for p in packs} == {3} and {p.purpose for p in packs} == {"sft"}
    assert [len(p.rollouts) for p in packs] == [2, 2, 1]


def test_without_a_demonstration_count_only_full_packs_go_out():
    g = grouper(pack=2)  # logs from before RolloutRequest.demonstrations: the old behaviour
    out = [g.add(rollout(f"d{i}", 0, group=f"sft{i}", size=1, purpose="sft")) for i in range(3)]
    assert [o is None for o in out] == [True, False, True] and out[1].message.packs == 0


def test_a_pack_of_unusable_demonstrations_is_a_counted_drop():
    g = grouper(pack=1)
    bad = rollout("d0", 0, group="sft0", size=1, purpose="sft", demonstrations=1)
    bad = msgspec.structs.replace(bad, calls=[])  # no model call at all: nothing to train
    msg = g.add(bad).message
    assert isinstance(msg, GroupDropped) and msg.purpose == "sft" and msg.packs == 1
