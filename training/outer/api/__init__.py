"""The outer loop as a library around the user's own model and training loop.

::

    model = MyModel(); opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    with (
        BlockingNode(store, key_path=KEY, bootstrap=[...], pubsub=True, dht=False) as node,
        OuterLoop(node, spec=SPEC_ID, model=model, certificate=CERT, rounds=10) as loop,
    ):
        loop.join()                  # adopt the run's state (S_0, or the tip when joining)
        for batch in loader:
            loss_fn(model(batch)).backward(); opt.step(); opt.zero_grad()
            loop.step()              # every H steps: update out, closure agreed, applied
            if loop.finished:
                break

From trio, ``async with open_outer_loop(node, key=KEY, spec=..., ...) as loop`` with
``await loop.join()`` and ``await loop.step()``.

At the ``replayed`` level the library drives the inner steps itself (point 7)::

    STEP = InnerStep("tinylm-next-token/v1", lambda model, batch: loss_of(model, batch))
    with OuterLoop(node, spec=SPEC_ID, model=model, certificate=CERT, rounds=10,
                   inner_step=STEP, data=RECORDS) as loop:
        result = loop.run()          # every round: H steps on committed rows, replayable

Theory of operation
-------------------
1. **Two threads, one hand-off.** The worker (``training.outer.worker``: gossip, agreement,
   aggregation, replay verdicts) runs as a task in the node's trio loop; the user's loop
   runs in the user's thread. They meet in a :class:`_Handoff`: for each round the worker
   posts the state S_r it starts from and waits for an update; the user's ``step()``
   counts inner steps and at the H-th builds the update from S_r (pseudo-gradient
   S_r - model in float32, SparseLoCo with error feedback), posts it, and waits for the
   next state, which it copies into the model's parameters in place. The worker posts
   S_{r+1} as soon as it has computed it and checked its root against the closure, ahead
   of keeping its state blob and signing its milestone, which then overlap the user's
   next steps; should that state not be adopted after all (its closure bad or beaten),
   the update made from it is dropped and the adopted state posted. When the worker
   leaves (its rounds are done) it posts the final state and ``finished`` turns true.
2. **The user's things stay the user's.** Parameters stay on their device and dtype
   (float32 or bfloat16; CPU or CUDA: the CUDA path is this same code, tested on CPU);
   the inner optimizer is never touched (DiLoCo keeps it across rounds); torch threads are
   as the user set them. The outer state (parameters, momentum, residual) stays in host
   memory as float32. A bfloat16 model's pseudo-gradient includes the rounding of S_r to
   bfloat16; error feedback carries it to the next round.
3. **Refused before step 0**, in one line: a model whose trainable parameters differ from
   the spec's names and shapes; a worker offering less verification than the spec's
   minimum; a certificate for another kernel class than this process's.
4. **Verification levels** (``training.outer.spec`` point 3). ``bounded``: the library
   does not drive the loop, so nothing is replayed; every update is held to the norm and
   direction rules of ``training.outer.aggregate``. ``scored``: with ``eval_fn(model,
   batch) -> loss`` and evaluation rows (an int64 array or a records blob), the proposer
   of each closure scores every candidate update by the loss change it makes alone on
   :data:`SCORE_ROWS` rows drawn from the round's root (Templar's Gauntlet), on a copy of
   the model, and leaves out an update that makes the loss worse, with that reason.
   ``replayed`` is offered by workers the library drives (``blob outer worker --spec
   --data``): a sample of their updates is recomputed from the rows they commit to.
5. **Bounds.** Every wait of the hand-off is bounded (:data:`HANDOFF_WAIT`); the worker's
   own waits are its own (``training.outer.worker``). A loop closed while the worker waits
   ends the worker with an error, not a hang.
6. **A worker that is a torch.distributed group** of replicas (DDP within a node): rank 0
   holds the node and is the run's one peer; every rank counts its steps, and at each
   round's end (and at join) rank 0's parameters, which hold the applied state, are
   broadcast over the group, with whether the run finished. Every rank is left with the
   same state. A model sharded over the group (FSDP2, ``torch.distributed.fsdp.fully_shard``,
   whose parameters are DTensors on a mesh of the group's ranks) is gathered instead: at a
   round's end every rank takes part in ``full_tensor()`` per parameter (in name order) so
   rank 0 holds the whole model for the update, and the applied state is scattered back
   from rank 0 (``distribute_tensor``), each rank keeping its shard. Memory on rank 0 is
   then the whole model in float32 at the round's end, as for an unsharded worker.
7. **The replayed level** (``inner_step`` and ``data``). Replay needs the rows, the inner
   optimizer's state and the step itself, so the library runs the round: an
   :class:`InnerStep` (a name and ``fn(model, batch) -> loss``) on batches of rows of the
   records blob ``data``, drawn by the worker's sampler and written into its update's
   commitment, with the library's own inner AdamW (the spec's ``inner_lr``, kept across
   rounds; ``inner_optimizer`` is not used) and the causal-LM recipe's clipping
   (``training.outer.trainer``). ``run()`` takes part in the worker's rounds and leaves the
   final state in the model. The spec names the step (``RunSpec.step``); a worker whose
   step has another name is refused before step 0. Other workers replay a sampled update
   with *their own* function of that name on a fresh copy of *their own* model (made when
   the loop is, before any training), so every worker of the run must run the same model
   class and step function under that name, with the same buffers and frozen parameters;
   an author whose function differs (a cheat or a bug) fails replay like any mismatch.
   Records other than the spec's ``data`` offer ``bounded``. Not with a ``group``; the
   blocking face only (``open_outer_loop`` takes no ``inner_step``). The store must hold
   the records blob (fetch it by ID first, as the spec). In a run that overlaps rounds
   the library trains each round ahead in a thread of its own and moves by the delayed
   outer step where the state comes (``training.outer.trainer`` rules 4 to 7); the
   commitment names the state the steps began from and the step it moved at, so the
   round replays as a blocking one does.

Where the code is
-----------------
One module per job, in import order: ``handoff`` (point 1: the hand-off and
:class:`OuterLoopError`), ``model`` (the user's model as float32 arrays, in and out;
point 6's gather), ``scoring`` (point 4), ``user_trainer`` (the worker's trainer for the
user's loop), ``overlap`` (an overlapped round's end, on a thread of its own), ``driven``
(point 7: :class:`InnerStep` and the trainers the library drives), ``core`` (what both
faces share, and the worker's task), ``blocking`` (:class:`OuterLoop`) and ``trio_face``
(:func:`open_outer_loop`).
"""

from training.outer.api.blocking import OuterLoop
from training.outer.api.driven import InnerStep, check_step
from training.outer.api.handoff import OuterLoopError
from training.outer.api.trio_face import AsyncOuterLoop, open_outer_loop

__all__ = [
    "AsyncOuterLoop",
    "InnerStep",
    "OuterLoop",
    "OuterLoopError",
    "check_step",
    "open_outer_loop",
]
