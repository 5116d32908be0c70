"""``fold.autobatch``: run unchanged per-example eager code batched.

The package, one job per file, each importing only the ones above it in this list:
``common`` (the C extension, per-thread state, modes, names), ``values`` (lazy values),
``buffers`` (tensors an example made and writes recorded values into), ``running`` (norms'
running statistics, updated in eager order), ``patches`` (what is installed in torch while
a call runs), ``batchable``, ``ops`` (recorded ops and how a group runs), ``tables`` (which torch calls run directly, which work in
place), ``recorder`` (op keys, the fast table, shape inference), ``traced`` (recordings that
stand for a whole batch or group), ``driver`` (``autobatch`` itself, stacking the results).
``fold.autobatch`` is the function; the parts are imported as ``from fold.autobatch import
recorder`` (``import fold.autobatch.recorder`` would look the part up on the function).

The user's function is written for ONE example, with no batch dim, as under ``torch.vmap``::

    def encode(model, tree):
        if tree.is_leaf:
            return model.leaf(torch.tensor(tree.word))
        (lh, lc), (rh, rc) = encode(model, tree.left), encode(model, tree.right)
        return model.cell(lh, lc, rh, rc)

    h, c = fold.autobatch(lambda t: encode(model, t), trees)   # each (len(trees), hidden)

:func:`autobatch` calls it once per example with recording on.  Values that depend on a
recorded result are :class:`Lazy`: torch functions, tensor methods and operators on them
record one node each into a :class:`fold.Fold`; a ``@batchable`` function and an
``nn.Module`` call record one node per call.  Then the graph runs with fold's scheduler, every
group of same-signature calls as ONE batched call, and the per-example results come back
stacked along a new dim 0, values and gradients equal to running the function eagerly per
example and stacking.

How a call is recorded (the choices the contract leaves open):

- **Arguments.**  A Lazy value, and a tensor made per example (``torch.tensor(word)``, an
  image row), is a *batched* argument: the group receives the examples' values stacked along
  a new dim 0 (0-dim int64, bool and default-dtype tensors travel as Python numbers).  A leaf
  tensor that requires grad (a parameter) is *shared*: it is passed whole, and is part of
  the op, like every other argument: numbers, dims, shapes, dtypes, modules.  Calls whose
  shared arguments differ are different ops (``x * 0.5`` and ``x * 0.25`` never share a
  group); calls are grouped by op, shared arguments and the batched arguments' shapes.
- **What is recorded.**  A torch function, tensor method or operator is recorded when an
  argument is Lazy; otherwise it runs at once.  Inside ``autobatch`` an ``nn.Module`` call or
  a ``@batchable`` call is recorded whenever it has a batched argument, Lazy or made per
  example: ``model.embed(torch.tensor(word))`` run once per example is exactly the
  batch-of-one work autobatch removes.  A call with no batched argument runs at once.
- **How a group runs.**  Calls known to be batch-polymorphic run directly on the stacked
  arguments (elementwise ops, ``F.linear`` and ``nn.Linear``, ``nn.Embedding``, the RNN cells,
  activations, ``cat``/``chunk``/``softmax``-style ops, sorts, ``topk`` and the cumulative
  ops with their dim moved past the batch dim, a ``BatchModule``'s rows merged into its
  batch).  A dim is checked against the example's own rank: of a per-example number, torch
  takes dim 0 or -1 as the number itself (``torch.softmax(score, -1)`` is 1), where on the
  stacked numbers it would be the batch dim, so such calls run under vmap (as do dims out
  of range, which raise eager's IndexError).  ``nn.LSTM``/``GRU``/``RNN`` on one
  unbatched sequence ``(L, D)`` is one op for every length: a group holding sequences of
  several lengths runs as ONE call on them padded and packed (``pack_padded_sequence``),
  each example's outputs cut back to its length (``_Op.fold_op``, ``padded_call``).  Calls
  of ``tables._PADDED`` (matmul, softmax and kin, elementwise ops, sums and means with a
  dim) and row-wise modules (``Linear``, ``Embedding``, ...) on values of several shapes
  (attention over memories of several lengths) are one op per call site too
  (``recorder._group_padded``): a group of them runs as one call on the values padded to
  the largest, each part's outputs cut back to its shape (``_Op._padded_parts``).  A group of ``@batchable``
  per-example calls, and of calls of a module of the user's own recorded whole (whose
  buffers its calls cannot change, see below), runs as the calls the function (the module's
  forward) makes: the function is recorded once per
  op and autobatch call on lazy values standing for a group (it can only see their shapes,
  so the recording holds for every group of the call; the next call records it again, so
  Python state it reads, such as ``self.training``, is read afresh) and each call it makes
  runs once on the group's batch, in its own mode; a function that cannot be recorded so
  (it reads or changes a value, draws random numbers eagerly, returns one that depends on
  no argument) runs under vmap.  Every other call runs under ``torch.func.vmap``
  (``randomness="different"``), which gives vmap's semantics.  An op's first group under
  vmap is checked against one call of it on the group's first example (shapes and dtypes,
  not for random ops; a module's forward runs once more then, under no_grad): a batching
  rule of torch's that gives another shape
  (``torch.argmax(h, keepdim=True)`` of a matrix: ``(n, 1)`` against one call's ``(1, 1)``)
  makes the op's groups run one call per example, with a warning.
  ``@batchable(batched=True)`` declares a function already written for a batch in dim 0
  (an explicit fold op): it runs directly, and a ``list`` of Lazy values it is given becomes a
  :class:`fold.Ragged` (lists may differ in length across the group).
- **Shapes.**  Every recorded call's output shapes are inferred once per signature and
  cached, so ``x.shape``, ``x.size()`` and ``len(x)`` are known while recording.  A call
  that can change no tensor but its outputs (a torch function, but one whose name has
  "norm" or "embedding" given a shared tensor; ``Linear``, ``Embedding``, the RNN modules
  and cells, activations, ``Sequential`` of them) runs on one example's zeros: that costs
  one eager call, where fake tensors cost 1-3 ms a call, 100 ms for a GRU over 30 steps
  and 1.1 s of imports on their first use (``recorder._stateless``).  Any other call (a
  module of the user's own type, which may change a buffer) runs on fake tensors; each
  falls back to the other where it fails.  A shape error in the per-example code surfaces
  there, as a FoldError naming the line.
- **Gradient and autocast mode.**  A call recorded under ``torch.no_grad()`` (a target
  network, a stop-gradient) or in a ``torch.autocast`` region is another op than the same
  call recorded with gradients on and no autocast, and its group runs in the mode it was
  recorded in: no gradient reaches a no-grad call's parameters or flows through its
  results, and an autocast call computes in the autocast dtype, as in eager code.
- **Identical calls** on identical arguments share one node (fold memoises records): the
  functions are taken as pure.  Dropout inside a recorded call draws per row, as vmap does.
  A call that draws random numbers (shape inference sees it move the generator, or run an
  op torch tags as seeded; or a module holding a ``Dropout`` while one is training: in eval
  mode it is pure, looked at on every call) is a node of its own every time: two dropouts
  of one value, or Monte Carlo samples of one input, draw apart, as in eager code
  (``recorder._record_fresh``).
- **Modules vmap cannot run.**  A call of a module of the user's own type (or a
  ``Sequential``) is recorded whole and its group runs as a program of its forward's calls
  (above), or under vmap; where vmap cannot run it (a read in its forward), which is tried
  once on fake tensors when the call is first recorded, the module is run through instead:
  its forward runs as the function's own code, each call inside it recorded
  (``recorder._Inline``).  A module holding a recurrent module or cell (``nn.GRU``,
  ``nn.GRUCell``...: vmap has no rule for their ops, or runs them one call per example) is
  run through at once, without the try (``recorder._holds_recurrent``).
  The recurrent modules and cells given a batch of the example's own (``x.view(1, 1, -1)``,
  states ``(layers, 1, H)``) run a group as one call, the batches merged
  (``tables._merged_rnn``).
- **Buffers.**  A tensor the example made (``torch.zeros(T, H)``) and writes recorded values
  into in place (``buf[t] = h``) records each write out of place and stands for the written
  value for the rest of the call (``buffers``).
- **Reads.**  ``bool``, ``int``, ``float``, ``.item()``, ``.tolist()``, ``.numpy()`` of a Lazy
  value pause the example (each runs as a greenlet) until the round that computes it: when
  every unfinished example is paused, what was recorded since the last round runs as one
  batched round (earlier rounds' values enter as literal rows; the call's one Fold is
  emptied for each round, its recorders and fast tables kept, see ``Fold._renew``), and
  each paused example resumes with its value (see ``driver._Session``).  A call whose
  result's shape depends on the data, or that returns a Python value (``x[mask]``,
  ``nonzero``, ``unique``, ``torch.equal``: ``tables._READS``), reads its lazy arguments
  alike, then runs at once (``recorder._Recorder._read_call``); so does a call that a
  recorded count sizes (``x.repeat(n)``, ``x[:n]``), found by the shapes it gives for
  zeros and ones (``_SizedByData``).  A torch function
  whose lazy arguments all come from earlier rounds runs at once, as eager code (an index
  into an encoder's output); a pure method of such a value with plain arguments (``enc[i]``,
  ``enc[0] * 0``) runs at once, memoised per call: its result is a lazy value of that round
  (``values._memoised``); module and ``@batchable`` calls of such values are recorded,
  the values literal rows of the round.  Grad mode is restored per example across pauses
  (``driver._Session.pause``).  Inside a
  ``@batchable`` body, which runs batched, a read is a FoldError naming torch.where.
  In-place ops on a Lazy value (``scores.masked_fill_(mask, -inf)``, ``h[i] = v``,
  ``h += y``; an activation or dropout with ``inplace=True``, a function's or a module's:
  ``values.in_place_form``) are recorded out of place, the value object becoming the result (every name
  and list holding it sees the change; ``buffers.write_lazy``), for a value of the round
  and for one of an earlier round alike (``scores[tok] = -inf`` after ``tok =
  int(scores.argmax())``; ``total += loss`` across reads).  Where eager code would change
  another tensor too, they are FoldErrors: a view changed (``v = h[0:2]; v += 1``; an
  augmented assignment to an item, ``h[i] += v``, sets the view back and so writes ``h``;
  one to an item of a list, ``parts[0] += v``, does not: refused as ``v += 1``),
  or a value changed while a view of it is held: taken in the round (recorder
  ``views``), or of an earlier round's value, kept across a read, taken of its row at once
  (``h[0]``, ``h.detach()``, ``h.unbind()``, ``torch.narrow(h, ...)``) or through views of
  views: what may share memory with a value is noted as it is made, held weakly
  (``values.in_use``; a view let go in the line that took it shares nothing).  A change
  under ``torch.no_grad()`` keeps the value's gradient, as eager code's does
  (``buffers._changed_without_grad``).  A value recorded once for every row (tensor rows, below) that is a row itself or shares memory
  with a view records per example instead.  Writes of Lazy values into an eager tensor the
  example did not make are FoldErrors (see **Buffers**).  So is an eager tensor (not a view) that
  the function changes in place after a recorded call took it as an argument (a mask
  updated while its call waits for its round): the call would read the changed value; the
  error names the example and the call.
  Changed after a read, once the round that used it has run, it is fine.  A *view* a
  recorded call takes (``h + buf[0]``, ``buf`` a tensor that needs no gradient) is taken as
  a copy of its value at the call (the views of one tensor share its version counter, so no
  check could tell a change of the view from one elsewhere in its tensor); a row of a
  tensor autobatch iterates over, changed in place after a call took it, is a FoldError.
- **Module state.**  A module's forward runs with its round, once for the calls of all
  examples, reading the module's state then.  An example that sets a module up for itself
  after a recorded call of it in the round (``m.temperature = t``, ``m.train(flag)``: a
  plain attribute, a number, flag or string, set to a new value) gets a FoldError as it sets
  it; a parameter or buffer changed in place after a call read it (a version counted since)
  is a FoldError as the round begins (``recorder._Recorder.check_aliases``).  Set before
  the module's calls of a round (a schedule every example follows alike), it is read as
  eager code reads it.  The attribute check is a guard over the ``__setattr__`` of the
  classes of the modules the round's calls read, for the length of the call
  (``recorder._guard_class``).  A change made through ``.data`` counts no version and is
  not seen (as autograd does not see it).  A function recorded once for every row (below)
  is taken as pure: one that sets a module up per example should pass ``per_example=True``.
- A Lazy value is not a ``torch.Tensor`` (``isinstance`` says False); it carries ``shape``,
  ``dtype``, ``device``, ``ndim`` and ``size()``.
- Errors inside a batched call name the user's source line that first recorded that call.
- Caches of ops and shapes live for the process (they hold the modules and parameters they
  name); :func:`clear_cache` empties them.  So does a call's Fold: one that returned keeps
  it, emptied, with its fast tables, for the next call of the same function (at most two
  per function, sixteen functions), so that call's first round finds its ops' entries; a
  call that raised keeps nothing.
- **Recording in C.**  A call seen before in this autobatch call, with the same function,
  kind, modules, lazy arguments' metas and constant arguments (ints, bools, floats with a
  zero's sign, None, strings, dtypes; lists or tuples of lazy values, and a batched
  function's list of any length; a 0-dim number tensor as the last argument, a loss's
  target), is found by one lookup in the recorder's ``_fast``
  table (a lazy value of an earlier round counts as its row there, alone or in a list: a
  decoder's memory at every step): where ``fold/_clazy.c`` is built that lookup, the
  node's recording and the Lazy outputs run in C, from the ``batchable`` call, a Lazy
  method or ``__torch_function__``
  (``_C.fast``; ``_C.fast_key`` builds the key the slow path files each op under).  A call
  with keyword arguments is taken as the same call by position where it can be
  (``values._given``, in C too): keywords passing their defaults dropped (``F.relu(x)``
  reaches ``__torch_function__`` as ``relu(x, inplace=False)``), numbers, strings or None
  put at their parameters' places (``h.sum(dim=1, keepdim=True)``, ``F.softmax(h,
  dim=-1)``; builtins by ``values._BUILTIN_POSITIONAL``).  Every other call (a tensor by
  keyword, another grad or autocast mode, a new key) takes the Python slow path,
  ``_Recorder.record``, which alone builds op keys and raises errors.
  Without the extension (or with ``FOLD_RECORDER=python``) generated Python functions
  (``_fast_source``) do the lookup for lazy arguments, a module first, or a number tensor.
- **Module calls.**  For the length of an ``autobatch`` call (and only then),
  ``nn.Module.__call__`` is a wrapper that records module calls while autobatch records and
  passes every other call through, and ``torch.tensor`` one that records data holding lazy
  values (``torch.tensor([a, b])`` of recorded scalars: their stack, detached, in the dtype
  torch infers); ``torch.cat``, ``stack``, ``softmax``, ``F.softmax``, ``F.relu`` and kin
  hand a call on lazy values straight to ``Lazy.__torch_function__``
  (``patches._DIRECT_TORCH``, ``_DIRECT_FUNCTIONAL``); the factories and
  ``Tensor.new_*``/``expand`` get known values' tensors and recorded counts' ints
  (``patches._WRAPPERS``); a custom ``autograd.Function`` called on lazy values is
  recorded whole, its backward kept (``patches._apply_installed``, installed alone where a
  function is recorded once on tensor rows).  All are put back
  when the call returns; a wrapper another library installs over them meanwhile is never
  dropped (see ``_Patches``).  Installing costs about
  45 us per call.  A module's op runs the module as ``nn.Module.__call__`` does (forward and
  hooks): a subclass that overrides ``__call__`` had what it does around
  ``super().__call__`` recorded around the module's node.
- **Examples from a tensor.**  A tensor passed as an iterable is split into its rows in one
  call (as iterating it gives), and each row's batched form (its batch-of-one view, or the
  Python number of a 0-dim row) is prepared with it, not per call.
- **One recording for tensor rows.**  Where every iterable is a tensor (``autobatch(loss,
  images, labels)``; or a list of tensors of one shape, of Python numbers of one type, or of
  samples alike whose fields are such: ``(image, int label)``, each number per row a
  ``values.RowNumber`` that ``torch.tensor([y])`` and ``out[y]`` take as its rows' values
  and any other Python use reads), the examples differ only in their rows' values, which the per-example
  code cannot read without a FoldError; so it records the same calls for every example.
  autobatch then calls ``fn`` ONCE, on lazy rows standing for all examples (row shape,
  dtype, device), and runs each recorded call once on the whole batch, in the same modes
  (direct, vmap, batched) a group of those calls runs in; values made inside ``fn`` that
  depend on no row are the same for every example and are repeated over the batch.  This
  is what ``torch.vmap(fn)(images, labels)`` computes, without vmap's per-op cost where a
  call runs directly.  A read (``if p.max() > 0.5:``, ``int(label)``) runs the calls recorded
  so far on the whole batch (``traced._Lockstep``): where every row reads one value, ``fn``
  goes on with it, the rows in lockstep; where the rows disagree, ``fn`` is recorded again
  for each group of rows that read one value (each earlier read answered as it was, the
  calls run before reused for the group's rows, not run again), and the groups' results go
  back in the rows' order.  It falls back to recording per example, which gives the same
  values (or the error naming the example), where the reads split the rows into more groups
  than half the rows (``float`` of a value that differs in every row), a call that may
  change a module's buffers (a batch norm in training) would run before a read or in a
  group, the groups return results of different structures or shapes, given the same reads
  ``fn`` records other calls (it is not pure), ``fn`` changes a row in
  place, draws random numbers eagerly (``torch.randn(3)`` with no lazy argument: one draw
  would be shared by every example; the random state is put back, so per example it draws
  what eager code draws), returns something other than tensors and numbers, gives a
  ``batched=True`` function an empty list, or a call's batched output disagrees with the
  shape inferred for it; that function (by its code) and row shapes then record per
  example from the start.  (Shape inference never draws from the random stream.)  Only
  torch's default generators are checked: a draw from Python's ``random`` or numpy inside
  ``fn`` (a coin flip for augmentation) is made once and shared by every row; checking
  their states costs 30-90 us a call, so such code should pass ``per_example=True``.
  Consequences: ``fn`` runs once per group of rows, not once per example (its side effects
  happen so; as elsewhere the functions are taken as pure), and results may be views of the inputs where
  a call returns one (``x[0]``), as under vmap.  ``autobatch(..., per_example=True)`` always
  records per example.  Rows of unequal tensors pair up as ``zip`` pairs them.
"""

from __future__ import annotations

from fold.autobatch.batchable import batchable as batchable
from fold.autobatch.driver import autobatch as autobatch
from fold.autobatch.driver import clear_cache as clear_cache
from fold.autobatch.driver import record_examples as record_examples
from fold.autobatch.values import Lazy as Lazy

__all__ = ["Lazy", "autobatch", "batchable", "clear_cache", "record_examples"]
