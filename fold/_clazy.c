/* fold._clazy: the hot path of autobatch's recording (fold/autobatch/), in C.

   Inside fold.autobatch every @fold.batchable call, tensor method, operator and torch
   function on a lazy value records a node.  A call seen before is found in the recorder's
   ``_fast`` table by its fast key (see key_build: the function, the kind, a module first,
   the lazy values' metas, constant numbers, lists of lazy values), and its node recorded
   by the op's Fold recorder.  In Python that took ~5 us a call (descriptor, __call__, the
   thread-local recorder, the mode check, the key, two lambdas, the Lazy outputs); here it
   is one C call.

   What is here (fold/autobatch/ uses each where this module was built, and its own Python
   otherwise; FOLD_RECORDER=python turns both C fast paths off):

   - LazyBase: the storage of fold.autobatch.Lazy (node, meta, rec), so Lazy values are made
     without running Python.
   - fast(rec, fn, kind, args): the table lookup, for up to MAX_FAST arguments.  _MISS
     where the call has no fast key or its key is new; the Python slow path
     (fold.autobatch.recorder._Recorder.record) then builds the op key, records the node, and files the
     op's entry under fast_key(rec, fn, kind, args).  A table entry is (recorder, outputs,
     wrap): outputs is the single output's meta, a tuple of metas for a flat tuple of
     outputs, or None, where wrap(nodes, rec) makes the outputs.
   - BatchableBase: the call and descriptor of fold.batchable.  Its call takes the fast path
     while autobatch records (fold.autobatch.common._LOCAL.rec set, not paused, no batched function
     running) with gradients on, no autocast and no keywords; every other call goes to the
     Python ``_call``.
   - Method: a tensor method or operator of Lazy (``x * y``, ``x.sum()``).
   - torch_function: Lazy.__torch_function__ (``torch.tanh(x)``).
   - Direct: torch functions that go to Lazy.__torch_function__ at once (``torch.cat([h, x])``).

   The fast key must never join calls the slow path keys apart (key_build says how each
   item keeps them apart); tests/test_clazy.py checks that every call the fast paths find
   gives what the slow path gives.  Without this module, the generated Python of
   fold.autobatch.recorder._fast_source takes the narrower keys it files itself. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <string.h>
#include <structmember.h>

#define MAX_FAST 16

/* Set once by configure() from fold/autobatch/values.py. */
static PyObject *g_lazy_type;      /* fold.autobatch.Lazy, a subclass of LazyBase */
static PyObject *g_module_type;    /* torch.nn.Module */
static PyObject *g_tensor_type;    /* torch.Tensor */
static PyObject *g_written;        /* buffers._Written (configure_written), or NULL */
static PyObject *g_miss;           /* fold.autobatch.common._MISS */
static PyObject *g_local;          /* fold.autobatch.common._LOCAL */
static PyObject *g_grad_enabled;   /* torch.is_grad_enabled */
static PyObject *g_any_autocast;   /* torch._C._is_any_autocast_enabled */
static PyObject *g_torch_kind;     /* "torch", the kind of a torch function or method */
static PyObject *g_slow_method;    /* fold.autobatch.values._record_method(func, args, kwargs) */
static PyObject *g_slow_function;  /* fold.autobatch.values._torch_function(cls, func, types, args, kw) */
static PyObject *g_batched_kind;   /* fold.autobatch.common._BATCHED, the kind of a batched=True function */
static PyObject *g_long, *g_bool;  /* torch.long, torch.bool */
static PyObject *g_strided;        /* torch.strided */
static PyObject *s_layout;
static PyObject *g_default_dtype;  /* torch.get_default_dtype */
static PyObject *g_known_type;     /* fold.autobatch.values.Known */
static PyObject *g_small[64];      /* the ints 0..63 (list lengths in keys) */
static PyObject *g_pure;           /* fold.autobatch.values._PURE_METHODS (set by configure_memo) */
static PyObject *g_inference_enabled; /* torch.is_inference_mode_enabled (configure_memo) */
static PyObject *g_memo_wrap;      /* fold.autobatch.values._memo_wrap(rec, out, key, memo, x) */
static PyObject *g_memo_views;     /* values._VIEW_METHODS: memoised methods whose result is a view */
static PyObject *g_note_shared;    /* values._mark_shared(args, out) (configure_memo) */
static PyObject *g_detach;         /* torch.Tensor.detach (configure_memo) */
static PyObject *g_inplace_index;  /* values._INPLACE_INDEX: function -> its inplace parameter */
static PyObject *g_inplace_modules; /* values._IN_PLACE_MODULES (configure_in_place) */
static int in_place_call(PyObject *func, PyObject *const *args, Py_ssize_t n);
static int in_place_module(PyObject *module);

static PyObject *s_rec, *s_paused, *s_running, *s_fast, *s_item, *s_ndim, *s_requires_grad,
    *s_dtype, *s_device, *s_call, *s_number, *s_meta, *s_value, *s_fast_nograd, *s_is_leaf,
    *s_shape, *s_unsqueeze, *s_row, *s_rows, *s_values, *s_session, *s_narrow, *s_rows_of,
    *s_current;

static PyObject *s_row_literal, *s_row_of, *s_memo, *s_rounds, *s_row_views;
static PyObject *s_token, *s_eager, *s_record, *s_module_kind, *s_literals, *s_aliases,
    *s_version, *s_example, *s_base, *s_is_inference, *s_clone;
static PyObject *s_state, *s_note_state;

/* ------------------------------------------------------------------------- LazyBase */

typedef struct {
    PyObject_HEAD
    PyObject *node;
    PyObject *meta;
    PyObject *rec;
    PyObject *weakrefs; /* (the values that share memory hold each other weakly: values.py) */
} LazyBase;

static PyTypeObject LazyBaseType;

/* LazyBase(node, meta, rec): the fields are set here.  meta is read-only from Python; node
   (and rec, for a value of an earlier round) is set again by an in-place change of the value
   (fold/autobatch/buffers.py, write_lazy: the value becomes the node that computes its new
   value), so a lazy value never lacks one (but after tp_clear, which the fast paths check
   for).  Lazy's own __setattr__ refuses every other change. */
static PyObject *
lazy_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"node", "meta", "rec", NULL};
    PyObject *node, *meta, *rec;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO", names, &node, &meta, &rec))
        return NULL;
    LazyBase *self = (LazyBase *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(node);
    Py_INCREF(meta);
    Py_INCREF(rec);
    self->node = node;
    self->meta = meta;
    self->rec = rec;
    return (PyObject *)self;
}

static int
lazy_traverse(LazyBase *self, visitproc visit, void *arg)
{
    Py_VISIT(self->node);
    Py_VISIT(self->meta);
    Py_VISIT(self->rec);
    return 0;
}

static int
lazy_clear(LazyBase *self)
{
    Py_CLEAR(self->node);
    Py_CLEAR(self->meta);
    Py_CLEAR(self->rec);
    return 0;
}

static void
lazy_dealloc(LazyBase *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    lazy_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef lazy_members[] = {
    {"node", T_OBJECT_EX, offsetof(LazyBase, node), 0,
     "the recorded node (or trace handle); set by an in-place change of the value"},
    {"meta", T_OBJECT_EX, offsetof(LazyBase, meta), READONLY, "per-example shape, dtype, device"},
    {"rec", T_OBJECT_EX, offsetof(LazyBase, rec), 0,
     "the autobatch recorder; set with node where an in-place change makes a value of an "
     "earlier round one of the round recording"},
    {NULL},
};

/* x[key]: the recorded __getitem__ (a Method, set by configure_subscript).  A mapping's
   subscript, not a sequence's item: torch's indexing takes an index that is a sequence
   (PySequence_Check: an sq_item slot, which a Python __getitem__ fills) for a tuple of its
   items, with a warning, and read each item of a lazy index (W[idx] of a parameter W):
   a lazy value is one index, as a tensor is. */
static PyObject *g_subscript;

static PyObject *
lazy_subscript(PyObject *self, PyObject *key)
{
    if (g_subscript == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "fold._clazy is used through fold.autobatch only");
        return NULL;
    }
    PyObject *args[2] = {self, key};
    return PyObject_Vectorcall(g_subscript, args, 2, NULL);
}

static PyMappingMethods lazy_as_mapping = {.mp_subscript = lazy_subscript};

static PyTypeObject LazyBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fold._clazy.LazyBase",
    .tp_doc = PyDoc_STR("LazyBase(node, meta, rec): the storage of fold.autobatch.Lazy."),
    .tp_basicsize = sizeof(LazyBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = lazy_new,
    .tp_dealloc = (destructor)lazy_dealloc,
    .tp_traverse = (traverseproc)lazy_traverse,
    .tp_clear = (inquiry)lazy_clear,
    .tp_members = lazy_members,
    .tp_as_mapping = &lazy_as_mapping,
    .tp_weaklistoffset = offsetof(LazyBase, weakrefs),
};

#define LAZY(o) ((LazyBase *)(o))

/* A lazy value of ``rec`` with its fields set (tp_clear, reachable from Python code that a
   collection runs, leaves them NULL: such a value takes the slow path, which refuses it). */
static inline int
is_lazy_of(PyObject *a, PyObject *rec)
{
    return (PyObject *)Py_TYPE(a) == g_lazy_type && LAZY(a)->rec == rec && rec != NULL &&
           LAZY(a)->meta != NULL && LAZY(a)->node != NULL;
}

/* 0 with an error set where fold.autobatch has not called configure() (the module imported on
   its own): every path that calls back into Python checks it first. */
static int
configured(void)
{
    if (g_lazy_type != NULL)
        return 1;
    PyErr_SetString(PyExc_RuntimeError, "fold._clazy is used through fold.autobatch only");
    return 0;
}

static PyObject *
new_lazy(PyObject *node, PyObject *meta, PyObject *rec)
{
    PyTypeObject *t = (PyTypeObject *)g_lazy_type;
    LazyBase *o = (LazyBase *)t->tp_alloc(t, 0);
    if (o == NULL)
        return NULL;
    Py_INCREF(node);
    Py_INCREF(meta);
    Py_INCREF(rec);
    o->node = node;
    o->meta = meta;
    o->rec = rec;
    return (PyObject *)o;
}

/* ------------------------------------------------------------------------- fast */

static inline PyObject *
miss(void)
{
    Py_INCREF(g_miss);
    return g_miss;
}

/* 1 where ``t`` (an exact torch.Tensor) is 0-dim and needs no gradient, 0 where not, -1 on
   error: a per-example number tensor (``torch.tensor(word)``). */
static int
number_tensor(PyObject *t)
{
    PyObject *ndim = PyObject_GetAttr(t, s_ndim);
    if (ndim == NULL)
        return -1;
    int zero = PyLong_Check(ndim) && PyLong_AsLong(ndim) == 0;
    Py_DECREF(ndim);
    if (!zero)
        return 0;
    PyObject *grad = PyObject_GetAttr(t, s_requires_grad);
    if (grad == NULL)
        return -1;
    int needs = PyObject_IsTrue(grad);
    Py_DECREF(grad);
    return needs < 0 ? -1 : !needs;
}

/* 1 where tensor ``t`` is a leaf that requires grad and no view (a parameter: the slow
   path shares it, part of the op), 0 where not, -1 on error.  (A view of a parameter taken
   under torch.no_grad() is a leaf that requires grad too, a new one at every call, such as
   ``self.pos[:n]``: data, as the slow path's _part takes it.) */
static int
leaf_with_grad(PyObject *t)
{
    PyObject *v = PyObject_GetAttr(t, s_requires_grad);
    if (v == NULL)
        return -1;
    int grad = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (grad <= 0)
        return grad;
    if ((v = PyObject_GetAttr(t, s_is_leaf)) == NULL)
        return -1;
    int leaf = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (leaf <= 0)
        return leaf;
    if ((v = PyObject_GetAttr(t, s_base)) == NULL)
        return -1;
    int view = v != Py_None;
    Py_DECREF(v);
    return !view;
}

/* 1 where ``m`` (a module) hashes and compares by identity, as nn.Module does: the slow
   path keys such modules by themselves, any other by identity. */
static inline int
identity_keyed(PyObject *m)
{
    PyTypeObject *t = Py_TYPE(m);
    return t->tp_hash == PyBaseObject_Type.tp_hash &&
           t->tp_richcompare == PyBaseObject_Type.tp_richcompare;
}

/* The entry's outputs made from the recorder's result ``res`` (stolen). */
static PyObject *
emit(PyObject *entry, PyObject *res, PyObject *rec)
{
    PyObject *outs = PyTuple_GET_ITEM(entry, 1);
    PyObject *out;
    if (PyTuple_CheckExact(outs)) {
        Py_ssize_t m = PyTuple_GET_SIZE(outs);
        if (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) != m)
            goto wrap;
        out = PyTuple_New(m);
        if (out == NULL)
            goto done;
        for (Py_ssize_t j = 0; j < m; j++) {
            PyObject *v = new_lazy(PyTuple_GET_ITEM(res, j), PyTuple_GET_ITEM(outs, j), rec);
            if (v == NULL) {
                Py_CLEAR(out);
                goto done;
            }
            PyTuple_SET_ITEM(out, j, v);
        }
        goto done;
    }
    if (outs != Py_None) {
        out = new_lazy(res, outs, rec);
        goto done;
    }
wrap:
    out = PyObject_CallFunctionObjArgs(PyTuple_GET_ITEM(entry, 2), res, rec, NULL);
done:
    Py_DECREF(res);
    return out;
}

/* A call's fast key, built into ``k``: the items of the key, the nodes it passes to the op's
   recorder, and the 0-dim tensor (borrowed) whose .item() it passes where it takes one.

   The key is (fn, kind, then per argument): a lazy value of rec, or of an earlier round of
   rec's call (its row passed, see earlier_literal): its meta; an int, a bool, or a nonzero
   float: its type, then itself (types keep 1, True and 1.0 apart; zeros are left to the
   slow path, which keys -0.0 apart from 0.0); None; a list or tuple of such lazy values (not
   for a batched=True function, whose lists become Ragged): its type, its length, their
   metas; a known value that travels as a number (torch.tensor(word)): Known, its meta; any
   other known value: Known, its meta, False (its batch-of-one row, Known.row, passed
   to the recorder); a plain tensor that is no leaf needing a gradient and no row of a
   tensor autobatch iterates over (an eager result: a row of an earlier round, a cat of
   them): torch.Tensor, its shape, dtype and device (its batch-of-one row passed); a module,
   first: itself, where it hashes and compares by identity.  The slow path
   (fold.autobatch.recorder._Recorder.record) makes one op of all calls whose fast keys are
   equal: each item above is what its key holds, or tells apart what its key tells apart.
   And, as fold.autobatch.recorder._NUMBER_BRANCH: a 0-dim tensor that needs no gradient,
   alone or after a module: (fn, kind, [module,] dtype, device). */
#define MAX_ITEMS 64
#define MAX_NODES 64

/* Every reference a Key holds is its own: building a key and the call after it run Python
   (a module's __hash__ and __eq__ in the table lookup, a collection, the recorder), which may
   drop what the arguments held (a list argument emptied, a lazy value cleared). */
typedef struct {
    PyObject *items[MAX_ITEMS];
    PyObject *nodes[MAX_NODES];
    PyObject *number; /* the number tensor whose .item() the recorder takes, or NULL */
    Py_ssize_t nk, nn;
    int shared; /* whether a shared tensor is among the items (see note_call) */
} Key;

static inline void
key_item(Key *k, PyObject *o)
{
    Py_INCREF(o);
    k->items[k->nk++] = o;
}

static inline void
key_node(Key *k, PyObject *o)
{
    Py_INCREF(o);
    k->nodes[k->nn++] = o;
}

static void
key_release(Key *k)
{
    for (Py_ssize_t i = 0; i < k->nk; i++)
        Py_DECREF(k->items[i]);
    for (Py_ssize_t i = 0; i < k->nn; i++)
        Py_DECREF(k->nodes[i]);
    Py_CLEAR(k->number);
    k->nk = k->nn = 0;
}

/* ``row._version``, or None for an inference tensor (values.version_of); NULL on error. */
static PyObject *
row_version(PyObject *row)
{
    PyObject *inference = PyObject_CallMethodNoArgs(row, s_is_inference);
    if (inference == NULL)
        return NULL;
    Py_DECREF(inference);
    return inference == Py_True ? Py_NewRef(Py_None) : PyObject_GetAttr(row, s_version);
}

/* As the slow path's _part: (tensor, its version, the example, the call's fn and kind) in
   ``rec.aliases``, for a tensor (not a view: views of one tensor share its version) whose
   literal row is a view of it (a change in place before its round runs is an error there,
   naming the call, not a silent change of the recorded call's argument).  1 for a view of
   any tensor but a leaf that needs a gradient (recorder._snapshot: the caller copies its
   row now), 0 for any other view or once noted, -1 on error. */
static int
note_alias(PyObject *rec, PyObject *a, PyObject *version, PyObject *fn, PyObject *kind)
{
    PyObject *base = PyObject_GetAttr(a, s_base);
    if (base == NULL)
        return -1;
    if (base != Py_None) { /* copied unless a leaf that needs a gradient (a parameter) */
        PyObject *grad = PyObject_GetAttr(base, s_requires_grad);
        int needs = grad == NULL ? -1 : PyObject_IsTrue(grad);
        Py_XDECREF(grad);
        if (needs > 0) {
            PyObject *leaf = PyObject_GetAttr(base, s_is_leaf);
            needs = leaf == NULL ? -1 : PyObject_IsTrue(leaf);
            Py_XDECREF(leaf);
        }
        Py_DECREF(base);
        return needs < 0 ? -1 : !needs;
    }
    Py_DECREF(base);
    PyObject *aliases = PyObject_GetAttr(rec, s_aliases);
    if (aliases == NULL)
        return -1;
    int out = 0;
    if (PyList_CheckExact(aliases)) {
        PyObject *example = PyObject_GetAttr(rec, s_example);
        PyObject *entry = example ? PyTuple_Pack(5, a, version, example, fn, kind) : NULL;
        out = entry == NULL || PyList_Append(aliases, entry) < 0 ? -1 : 0;
        Py_XDECREF(entry);
        Py_XDECREF(example);
    }
    Py_DECREF(aliases);
    return out;
}

/* The state of ``obj`` (a module called, a parameter given) noted at its first recorded
   call of the round, as the slow path notes it (recorder._Recorder.note_state: the call
   runs with the round and reads it then): 0, -1 on error. */
static PyObject *noted_rec; /* the recorder ``noted`` is of (compared, never read) */
static PyObject *noted[16];  /* objects noted in its round (compared, never read) */
static int noted_n;

static int
note_state(PyObject *rec, PyObject *obj)
{
    /* (the objects a step calls again and again, found here without Python: a new
       recorder, a round's, empties the list, see forget_noted) */
    if (rec == noted_rec) {
        for (int i = 0; i < noted_n; i++)
            if (noted[i] == obj)
                return 0;
    }
    else {
        noted_rec = rec;
        noted_n = 0;
    }
    PyObject *state = PyObject_GetAttr(rec, s_state);
    if (state == NULL) { /* (a recorder without one notes nothing) */
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    int out = 0;
    if (PyDict_CheckExact(state)) {
        PyObject *key = PyLong_FromVoidPtr(obj);
        int has = key == NULL ? -1 : PyDict_Contains(state, key);
        Py_XDECREF(key);
        if (has == 0) {
            PyObject *r = PyObject_CallMethodOneArg(rec, s_note_state, obj);
            has = r == NULL ? -1 : 1;
            Py_XDECREF(r);
        }
        out = has < 0 ? -1 : 0;
        if (has > 0 && noted_n < 16)
            noted[noted_n++] = obj;
    }
    Py_DECREF(state);
    return out;
}

/* forget_noted(): a recorder begins (its round's objects are noted anew, see note_state). */
static PyObject *
forget_noted(PyObject *module, PyObject *unused)
{
    noted_rec = NULL;
    noted_n = 0;
    Py_RETURN_NONE;
}

/* The state a call found in the fast table reads when its node runs with the round, noted
   as the slow path's _Recorder._note_call notes it: the module called, and the shared
   tensors of its key (a parameter: the marker, then the tensor; a literal row's marker is
   followed by its shape).  0, -1 on error. */
static int
note_call(Key *k, PyObject *rec, PyObject *fn, PyObject *kind)
{
    if (kind == s_module_kind && note_state(rec, fn) < 0) /* (the interned "module") */
        return -1;
    if (!k->shared)
        return 0;
    for (Py_ssize_t i = 0; i + 1 < k->nk; i++)
        if (k->items[i] == g_tensor_type &&
            PyObject_TypeCheck(k->items[i + 1], (PyTypeObject *)g_tensor_type) &&
            note_state(rec, k->items[i + 1]) < 0)
            return -1;
    return 0;
}

/* A leaf tensor that requires grad (a parameter ``W`` in ``W @ h``, shared by every call;
   the slow path's _part makes it part of the op by identity, no node): the tensor itself,
   after a marker, as in a list below.  1 where put in ``k``, 0 where there is no room. */
static int
shared_tensor(Key *k, PyObject *a)
{
    if (k->nk + 2 > MAX_ITEMS)
        return 0;
    key_item(k, g_tensor_type);
    key_item(k, a);
    k->shared = 1;
    return 1;
}

/* A per-example tensor of one or more dims that is no leaf needing a gradient (an eager
   result inside the function: a row of an earlier round, a cat of them, a torch.zeros) and
   no row of a tensor autobatch iterates over (rec._rows): as the slow path's _part, a
   batch-of-one literal row, keyed by (torch.Tensor, shape, dtype, device).  1 where put in
   ``k``, 0 where the slow path takes it, -1 on error. */
/* Whether the thread runs inside a torch.func transform (torch._C._functorch's
   peek_interpreter_stack gives a level): a call there runs at once, the slow path's
   _Recorder._in_transform.  1, 0, -1 on error. */
static PyObject *g_peek; /* (looked up once) */

static int
in_transform(void)
{
    if (g_peek == NULL) {
        PyObject *c = PyImport_ImportModule("torch._C");
        PyObject *f = c ? PyObject_GetAttrString(c, "_functorch") : NULL;
        Py_XDECREF(c);
        g_peek = f ? PyObject_GetAttrString(f, "peek_interpreter_stack") : NULL;
        Py_XDECREF(f);
        if (g_peek == NULL)
            return -1;
    }
    PyObject *level = PyObject_CallNoArgs(g_peek);
    if (level == NULL)
        return -1;
    int inside = level != Py_None;
    Py_DECREF(level);
    return inside;
}

static int
tensor_row(Key *k, PyObject *rec, PyObject *a)
{
    if (k->nk + 4 > MAX_ITEMS || k->nn >= MAX_NODES)
        return 0;
    int transform = in_transform(); /* (its tensors are the transform's: run at once) */
    if (transform != 0)
        return transform < 0 ? -1 : 0;
    int shared = leaf_with_grad(a);
    if (shared != 0)
        return shared < 0 ? -1 : shared_tensor(k, a);
    PyObject *rows = PyObject_GetAttr(rec, s_rows);
    if (rows == NULL)
        return -1;
    PyObject *id = PyLong_FromVoidPtr(a);
    int listed = id == NULL ? -1 : PyDict_Check(rows) ? PyDict_Contains(rows, id) : 1;
    Py_XDECREF(id);
    Py_DECREF(rows);
    if (listed != 0)
        return listed < 0 ? -1 : 0;
    /* A sparse tensor (a graph's adjacency per example): the slow path, whose meta keeps
       its layout (a key of its own, never padded). */
    PyObject *layout = PyObject_GetAttr(a, s_layout);
    if (layout == NULL)
        return -1;
    Py_DECREF(layout); /* (compared by identity: torch.strided lives on) */
    if (layout != g_strided)
        return 0;
    PyObject *version = row_version(a);
    if (version == NULL)
        return -1;
    PyObject *shape = PyObject_GetAttr(a, s_shape);
    PyObject *dtype = shape ? PyObject_GetAttr(a, s_dtype) : NULL;
    PyObject *device = dtype ? PyObject_GetAttr(a, s_device) : NULL;
    PyObject *row = device ? PyObject_CallMethodOneArg(a, s_unsqueeze, g_small[0]) : NULL;
    /* An inference tensor has no version counter to see a later change by: its value
       now, copied, as eager code reads it at the call (the slow path's _part alike). */
    int noted = 0;
    if (row == NULL)
        noted = -1;
    else if (version == Py_None)
        Py_SETREF(row, PyObject_CallMethodNoArgs(row, s_clone));
    else { /* (items 0 and 1: fn, kind) */
        noted = note_alias(rec, a, version, k->items[0], k->items[1]);
        if (noted == 1) { /* a view of a tensor that needs no gradient: its value now */
            Py_SETREF(row, PyObject_CallMethodNoArgs(row, s_clone));
            noted = 0;
        }
    }
    Py_DECREF(version);
    if (row == NULL)
        noted = -1;
    if (noted < 0) {
        Py_XDECREF(row);
        Py_XDECREF(shape);
        Py_XDECREF(dtype);
        Py_XDECREF(device);
        return -1;
    }
    key_item(k, g_tensor_type);
    k->items[k->nk++] = shape; /* owned */
    k->items[k->nk++] = dtype;
    k->items[k->nk++] = device;
    k->nodes[k->nn++] = row;
    return 1;
}

/* Row ``row`` of ``src`` (an output of ``old``'s round) as the batch-of-one view
   _Recorder.row_literal gives from the second row asked of a tensor on: its view of the one
   ``split`` kept in ``old._row_views``, or ``src`` itself where it has one row (a new
   reference); _MISS where that is not made yet or ``src`` is no plain tensor (row_literal
   makes it), NULL on error.  The views were made
   with gradients on where ``src`` carries them (row_literal), so they serve any mode. */
static PyObject *
split_view(PyObject *old, PyObject *src, PyObject *row)
{
    if ((PyObject *)Py_TYPE(src) != g_tensor_type || !PyLong_CheckExact(row))
        return miss();
    PyObject *table = PyObject_GetAttr(old, s_row_views);
    if (table == NULL)
        return NULL;
    PyObject *out = NULL;
    PyObject *key = PyDict_CheckExact(table) ? PyLong_FromVoidPtr(src) : NULL;
    PyObject *got = key ? PyDict_GetItemWithError(table, key) : NULL; /* borrowed */
    Py_XDECREF(key);
    if (got != NULL && PyTuple_CheckExact(got) && PyTuple_GET_SIZE(got) == 2 &&
        PyTuple_GET_ITEM(got, 0) == src && PyTuple_CheckExact(PyTuple_GET_ITEM(got, 1))) {
        PyObject *views = PyTuple_GET_ITEM(got, 1);
        Py_ssize_t i = PyLong_AsSsize_t(row);
        if (i >= 0 && i < PyTuple_GET_SIZE(views)) {
            out = PyTuple_GET_ITEM(views, i);
            Py_INCREF(out);
        }
        else if (PyErr_Occurred())
            PyErr_Clear();
    }
    Py_DECREF(table);
    if (out == NULL && !PyErr_Occurred()) {
        /* as row_literal: row 0 of a one-row output is the output itself */
        PyObject *shape = PyLong_AsLong(row) == 0 ? PyObject_GetAttr(src, s_shape) : NULL;
        if (shape != NULL && PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) >= 1 &&
            PyLong_Check(PyTuple_GET_ITEM(shape, 0)) &&
            PyLong_AsLong(PyTuple_GET_ITEM(shape, 0)) == 1) {
            out = src;
            Py_INCREF(out);
        }
        Py_XDECREF(shape);
        if (PyErr_Occurred()) {
            Py_CLEAR(out);
            return NULL;
        }
        if (out == NULL)
            out = miss();
    }
    return out;
}

/* A lazy value of an earlier round of ``rec``'s autobatch call (a decoder's memory, read by
   every later step): as the slow path's _part, its row of that round's output as a
   batch-of-one literal, in ``*literal``, made once per value (kept in its recorder's
   ``literals``: a memory read twice a step for 40 steps is one view, not 80).  1 where
   made, 0 where the slow path takes it (a value of another call, or of a round not run: the
   slow path says so), -1 on error. */
static int
earlier_literal(PyObject *rec, PyObject *a, PyObject **literal)
{
    PyObject *old = LAZY(a)->rec;
    PyObject *values = PyObject_GetAttr(old, s_values);
    if (values == NULL)
        return -1;
    if (!PyDict_CheckExact(values)) { /* None: its round has not run */
        Py_DECREF(values);
        return 0;
    }
    PyObject *mine = PyObject_GetAttr(old, s_session);
    PyObject *ours = mine ? PyObject_GetAttr(rec, s_session) : NULL;
    int same = ours != NULL && mine != Py_None && mine == ours;
    Py_XDECREF(mine);
    Py_XDECREF(ours);
    if (ours == NULL || !same) {
        Py_DECREF(values);
        return ours == NULL ? -1 : 0;
    }
    PyObject *node = LAZY(a)->node;
    PyObject *kept = PyObject_GetAttr(old, s_literals);
    if (kept == NULL) { /* (no table of its own: the view is made, not kept) */
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            Py_DECREF(values);
            return -1;
        }
        PyErr_Clear();
        kept = Py_None;
        Py_INCREF(kept);
    }
    if (PyDict_CheckExact(kept)) {
        PyObject *got = PyDict_GetItemWithError(kept, node); /* borrowed */
        if (got != NULL) {
            Py_INCREF(got);
            *literal = got;
            Py_DECREF(kept);
            Py_DECREF(values);
            return 1;
        }
        if (PyErr_Occurred()) {
            Py_DECREF(kept);
            Py_DECREF(values);
            return -1;
        }
    }
    PyObject *entry = PyDict_GetItemWithError(values, node); /* borrowed */
    if (entry == NULL || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2) {
        Py_DECREF(kept);
        Py_DECREF(values);
        return PyErr_Occurred() ? -1 : 0;
    }
    PyObject *src = PyTuple_GET_ITEM(entry, 0), *row = PyTuple_GET_ITEM(entry, 1);
    Py_INCREF(src);
    Py_INCREF(row);
    Py_DECREF(values);
    *literal = split_view(old, src, row);
    if (*literal == g_miss) {
        Py_DECREF(*literal);
        *literal = PyObject_CallMethodObjArgs(old, s_row_literal, src, row, NULL); /* as _part */
    }
    Py_DECREF(src);
    Py_DECREF(row);
    if (*literal != NULL && PyDict_CheckExact(kept) && PyDict_SetItem(kept, node, *literal) < 0)
        Py_CLEAR(*literal);
    Py_DECREF(kept);
    return *literal == NULL ? -1 : 1;
}

/* earlier_literal, keyed by the value's meta after a marker (_MISS): the slow path keys it
   by its meta alone, as a lazy value of this round, and records both as one op; the marker
   files the two apart here, so that each entry holds the Fold recorder made for its
   arguments' types (a node, or a literal row), as for the elements of a list below. */
static int
earlier_row(Key *k, PyObject *rec, PyObject *a)
{
    if (k->nk + 2 > MAX_ITEMS || k->nn >= MAX_NODES)
        return 0;
    PyObject *literal = NULL;
    int ok = earlier_literal(rec, a, &literal);
    if (ok <= 0)
        return ok;
    key_item(k, g_miss);
    key_item(k, LAZY(a)->meta);
    k->nodes[k->nn++] = literal;
    return 1;
}

/* Whether every item of tuple ``a`` is an index item (see index_items): an int or bool,
   None, Ellipsis or a slice (its parts not looked at here). */
static int
plain_index(PyObject *a)
{
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(a); j++) {
        PyObject *x = PyTuple_GET_ITEM(a, j);
        PyTypeObject *t = Py_TYPE(x);
        if (!(t == &PyLong_Type || t == &PyBool_Type || x == Py_None || x == Py_Ellipsis ||
              t == &PySlice_Type))
            return 0;
    }
    return 1;
}

/* An index (an int, a bool, None, Ellipsis, or a slice of ints and Nones: ``x[0, 0]``,
   ``h[:, -1]``, ``x[1:]``) as key items: the type before an int or bool (1 and True apart),
   the slice type before a slice's three parts; 1 where put in ``k``, 0 where ``x`` is none
   of those. */
static int
index_items(Key *k, PyObject *x)
{
    PyTypeObject *t = Py_TYPE(x);
    if (t == &PyLong_Type || t == &PyBool_Type) {
        if (k->nk + 2 > MAX_ITEMS)
            return 0;
        key_item(k, (PyObject *)t);
        key_item(k, x);
        return 1;
    }
    if (x == Py_None || x == Py_Ellipsis) {
        if (k->nk + 1 > MAX_ITEMS)
            return 0;
        key_item(k, x);
        return 1;
    }
    if (t != &PySlice_Type || k->nk + 4 > MAX_ITEMS)
        return 0;
    PySliceObject *sl = (PySliceObject *)x;
    PyObject *parts[3] = {sl->start, sl->stop, sl->step};
    for (int j = 0; j < 3; j++)
        if (parts[j] != Py_None && !PyLong_CheckExact(parts[j]))
            return 0;
    key_item(k, (PyObject *)t);
    for (int j = 0; j < 3; j++)
        key_item(k, parts[j]);
    return 1;
}

/* 1 where the call has a fast key (in k), 0 where not, -1 on error; k holds references in
   every case, for key_release. */
static int
key_build(Key *k, PyObject *rec, PyObject *fn, PyObject *kind, PyObject *const *args,
          Py_ssize_t n)
{
    k->nk = k->nn = 0;
    k->number = NULL;
    k->shared = 0;
    if (!configured())
        return -1;
    if (n < 1 || n > MAX_FAST)
        return 0;
    /* A module keyed by its own __eq__/__hash__ could join two modules that compare equal
       (the slow path keys modules by identity): such calls take the slow path. */
    if (PyObject_TypeCheck(fn, (PyTypeObject *)g_module_type) && !identity_keyed(fn))
        return 0;
    key_item(k, fn);
    key_item(k, kind);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = args[i];
        PyTypeObject *t = Py_TYPE(a);
        if (k->nk + 2 > MAX_ITEMS)
            return 0;
        if ((PyObject *)t == g_lazy_type && LAZY(a)->rec == rec) {
            if (k->nn >= MAX_NODES || !is_lazy_of(a, rec))
                return 0;
            key_item(k, LAZY(a)->meta);
            key_node(k, LAZY(a)->node);
        }
        else if ((PyObject *)t == g_lazy_type && LAZY(a)->rec != NULL && LAZY(a)->meta != NULL &&
                 LAZY(a)->node != NULL) {
            int ok = earlier_row(k, rec, a);
            if (ok <= 0)
                return ok;
        }
        else if (t == &PyLong_Type || t == &PyBool_Type ||
                 (t == &PyFloat_Type && PyFloat_AS_DOUBLE(a) != 0.0)) {
            key_item(k, (PyObject *)t);
            key_item(k, a);
        }
        else if (t == &PyFloat_Type) {
            /* A zero (``masked_fill(m, 0.0)``): its sign after it, since -0.0 == 0.0 for
               the table, and the two are other constants for the op. */
            if (k->nk + 3 > MAX_ITEMS)
                return 0;
            key_item(k, (PyObject *)t);
            key_item(k, a);
            key_item(k, signbit(PyFloat_AS_DOUBLE(a)) ? Py_True : Py_False);
        }
        else if (a == Py_None) {
            key_item(k, a);
        }
        else if (t == &PyUnicode_Type || (g_long != NULL && t == Py_TYPE(g_long))) {
            /* A string (einsum's equation, a mode) or a torch.dtype (``h.to(torch.half)``):
               a constant, after its type. */
            key_item(k, (PyObject *)t);
            key_item(k, a);
        }
        else if (t == &PySlice_Type || a == Py_Ellipsis) {
            if (!index_items(k, a))
                return 0;
        }
        else if (t == &PyTuple_Type && PyTuple_GET_SIZE(a) < 16 && plain_index(a)) {
            /* An index of several dims (x[0, 0], h[:, -1]): the tuple's items after a
               marker and its length. */
            Py_ssize_t m = PyTuple_GET_SIZE(a);
            if (k->nk + 2 > MAX_ITEMS)
                return 0;
            key_item(k, (PyObject *)t);
            key_item(k, g_small[m]);
            for (Py_ssize_t j = 0; j < m; j++)
                if (!index_items(k, PyTuple_GET_ITEM(a, j)))
                    return 0;
        }
        else if (t == &PyList_Type && kind == g_batched_kind) {
            /* A list of lazy values of this round, of one meta, given to a batched function
               (a fold.Ragged there, one op for every length): (list, BATCHED, the meta),
               its nodes as one list argument, as the slow path's _ragged passes them.  Any
               other list (empty, of several metas, holding other values) takes the slow
               path. */
            Py_ssize_t m = PyList_GET_SIZE(a);
            if (m == 0 || k->nn >= MAX_NODES || k->nk + 3 > MAX_ITEMS)
                return 0;
            PyObject *meta = NULL;
            for (Py_ssize_t j = 0; j < m; j++) {
                PyObject *x = PyList_GET_ITEM(a, j);
                if (!is_lazy_of(x, rec) || (meta != NULL && LAZY(x)->meta != meta))
                    return 0;
                meta = LAZY(x)->meta;
            }
            PyObject *nodes = PyList_New(m);
            if (nodes == NULL)
                return -1;
            for (Py_ssize_t j = 0; j < m; j++) {
                PyObject *node = LAZY(PyList_GET_ITEM(a, j))->node;
                Py_INCREF(node);
                PyList_SET_ITEM(nodes, j, node);
            }
            key_item(k, (PyObject *)t);
            key_item(k, g_batched_kind);
            key_item(k, meta);
            k->nodes[k->nn++] = nodes; /* owned */
        }
        else if ((t == &PyList_Type || t == &PyTuple_Type) && kind != g_batched_kind) {
            Py_ssize_t m = PySequence_Fast_GET_SIZE(a);
            PyObject **el = PySequence_Fast_ITEMS(a);
            if (m >= 64 || k->nk + 2 + m > MAX_ITEMS || k->nn + m > MAX_NODES)
                return 0;
            Py_ssize_t earlier = 0, params = 0;
            for (Py_ssize_t j = 0; j < m; j++) {
                if (is_lazy_of(el[j], rec))
                    continue;
                if ((PyObject *)Py_TYPE(el[j]) == g_lazy_type) {
                    if (LAZY(el[j])->rec == NULL || LAZY(el[j])->meta == NULL ||
                        LAZY(el[j])->node == NULL)
                        return 0;
                    earlier++; /* a value of an earlier round (a decoder's context) */
                    continue;
                }
                if (!PyObject_TypeCheck(el[j], (PyTypeObject *)g_tensor_type))
                    return 0;
                params++; /* a parameter (checked below): torch.cat([self.root, states]) */
            }
            if (k->nk + 2 + m + earlier + params > MAX_ITEMS) /* a marker: an item more */
                return 0;
            key_item(k, (PyObject *)t);
            key_item(k, g_small[m]);
            if (!earlier && !params) {
                /* No Python runs from here to the loop's end: the list keeps its elements. */
                for (Py_ssize_t j = 0; j < m; j++) {
                    key_item(k, LAZY(el[j])->meta);
                    key_node(k, LAZY(el[j])->node);
                }
                continue;
            }
            /* Reading earlier rounds' rows runs Python: the elements, held apart. */
            PyObject *items = PySequence_Tuple(a);
            if (items == NULL)
                return -1;
            for (Py_ssize_t j = 0; j < m && j < PyTuple_GET_SIZE(items); j++) {
                PyObject *x = PyTuple_GET_ITEM(items, j);
                if (is_lazy_of(x, rec)) {
                    key_item(k, LAZY(x)->meta);
                    key_node(k, LAZY(x)->node);
                    continue;
                }
                if ((PyObject *)Py_TYPE(x) != g_lazy_type) {
                    /* A leaf tensor that requires grad, shared by every call (the slow
                       path's _part: part of the op by identity, no node): the tensor
                       itself, after a marker. Any other tensor takes the slow path. */
                    int shared = PyObject_TypeCheck(x, (PyTypeObject *)g_tensor_type)
                                     ? leaf_with_grad(x)
                                     : 0;
                    if (shared <= 0) {
                        Py_DECREF(items);
                        return shared;
                    }
                    key_item(k, g_tensor_type);
                    key_item(k, x);
                    k->shared = 1;
                    continue;
                }
                PyObject *literal = NULL;
                int ok = LAZY(x)->rec != NULL && LAZY(x)->meta != NULL && LAZY(x)->node != NULL
                             ? earlier_literal(rec, x, &literal)
                             : 0;
                if (ok <= 0) {
                    Py_DECREF(items);
                    return ok;
                }
                key_item(k, g_miss); /* a row, filed apart from a node (earlier_row) */
                key_item(k, LAZY(x)->meta);
                k->nodes[k->nn++] = literal;
            }
            if (PyTuple_GET_SIZE(items) != m) { /* (changed under us: the slow path) */
                Py_DECREF(items);
                return 0;
            }
            Py_DECREF(items);
        }
        else if ((PyObject *)t == g_known_type) {
            /* A known value (torch.tensor(word) inside autobatch) that travels as a number:
               (Known, its meta), its value passed to the recorder. */
            PyObject *v = PyObject_GetAttr(a, s_number);
            if (v == NULL)
                return -1;
            int number = v == Py_True;
            Py_DECREF(v);
            if (k->nn >= MAX_NODES || k->nk + 3 > MAX_ITEMS)
                return 0;
            if ((v = PyObject_GetAttr(a, s_meta)) == NULL)
                return -1;
            key_item(k, g_known_type);
            k->items[k->nk++] = v; /* owned */
            if (number) {
                if ((v = PyObject_GetAttr(a, s_value)) == NULL)
                    return -1;
            }
            else {
                /* Any other known value: its tensor's batch-of-one row, as the slow path's
                   _part passes it (keyed apart from a number by the False after its meta). */
                key_item(k, Py_False);
                if ((v = PyObject_CallMethodNoArgs(a, s_row)) == NULL)
                    return -1;
            }
            k->nodes[k->nn++] = v; /* owned */
        }
        else if (i == 0 && PyObject_TypeCheck(a, (PyTypeObject *)g_module_type)) {
            if (!identity_keyed(a))
                return 0;
            key_item(k, a);
        }
        else if ((PyObject *)t == g_tensor_type) {
            /* A 0-dim tensor that needs no gradient, of a dtype that travels as a Python
               number (fold.autobatch.recorder._as_number: long, bool, the default dtype):
               as the last argument, (dtype, device) and its .item(); else a row. */
            int ok = number_tensor(a);
            if (ok < 0)
                return -1;
            PyObject *dtype = NULL;
            if (ok) {
                if ((dtype = PyObject_GetAttr(a, s_dtype)) == NULL)
                    return -1;
                if (dtype != g_long && dtype != g_bool) {
                    PyObject *d = PyObject_CallNoArgs(g_default_dtype);
                    if (d == NULL) {
                        Py_DECREF(dtype);
                        return -1;
                    }
                    Py_DECREF(d);
                    ok = d == dtype;
                }
            }
            if (!ok) {
                Py_XDECREF(dtype);
                if ((ok = tensor_row(k, rec, a)) <= 0)
                    return ok;
                continue;
            }
            /* Its .item() is the last node, taken once the entry is found: the last
               argument alone (a module's, a loss's target), after a marker. */
            if (i != n - 1 || k->number != NULL || k->nk + 3 > MAX_ITEMS ||
                k->nn >= MAX_NODES) {
                Py_DECREF(dtype);
                return 0;
            }
            key_item(k, s_item);
            k->items[k->nk++] = dtype; /* owned */
            PyObject *device = PyObject_GetAttr(a, s_device);
            if (device == NULL)
                return -1;
            k->items[k->nk++] = device;
            Py_INCREF(a);
            Py_XSETREF(k->number, a);
        }
        else if (PyObject_TypeCheck(a, (PyTypeObject *)g_tensor_type)) {
            /* A tensor subclass: an nn.Parameter is shared (see shared_tensor); any other
               takes the slow path: a written buffer at once, before its attributes are read
               (each a call of its Python __torch_function__), to be given as the value it
               holds (values._torch_function). */
            if ((PyObject *)Py_TYPE(a) == g_written)
                return 0;
            int shared = leaf_with_grad(a);
            if (shared <= 0)
                return shared;
            if (!shared_tensor(k, a))
                return 0;
        }
        else
            return 0;
    }
    return 1;
}

static PyObject *
key_tuple(Key *k)
{
    PyObject *key = PyTuple_New(k->nk);
    if (key == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < k->nk; i++) {
        Py_INCREF(k->items[i]);
        PyTuple_SET_ITEM(key, i, k->items[i]);
    }
    return key;
}

/* An entry (recorder, outs, wrap, log) of an op whose outputs share memory with its
   arguments (views: fold.autobatch.ops._Op.aliases): (its outputs, the call's arguments)
   appended to the recorder's list named ``log`` (``view_log``), which an in-place change
   reads (fold.autobatch.buffers.write_lazy).  0, or -1 on error. */
static int
log_view(PyObject *entry, PyObject *rec, PyObject *result, PyObject *const *args, Py_ssize_t n)
{
    PyObject *log = PyObject_GetAttr(rec, PyTuple_GET_ITEM(entry, 3));
    if (log == NULL)
        return -1;
    int rc = -1;
    PyObject *given = PyTuple_New(n);
    if (given != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_INCREF(args[i]);
            PyTuple_SET_ITEM(given, i, args[i]);
        }
        PyObject *item = PyTuple_Pack(2, result, given);
        if (item != NULL) {
            rc = PyList_Check(log) ? PyList_Append(log, item) : 0;
            Py_DECREF(item);
        }
        Py_DECREF(given);
    }
    Py_DECREF(log);
    return rc;
}

/* The fast path of a call of ``fn`` of ``kind`` on ``args``, recorded by ``rec``: its outputs,
   _MISS (a new reference) where it does not fit or its key is new, NULL on error. */
static PyObject *
fast_impl(PyObject *rec, PyObject *fn, PyObject *kind, PyObject *const *args, Py_ssize_t n,
          PyObject *table_name)
{
    Key k;
    k.nk = k.nn = 0;
    k.number = NULL;
    PyObject *result = NULL, *key = NULL;
    PyObject *table = PyObject_GetAttr(rec, table_name);
    if (table == NULL)
        return NULL;
    if (!PyDict_CheckExact(table)) {
        PyErr_SetString(PyExc_TypeError, "autobatch recorder's _fast is not a dict");
        goto out;
    }
    if (PyDict_GET_SIZE(table) == 0) { /* nothing to find (a closed recorder's): no key */
        result = miss();
        goto out;
    }
    int ok = key_build(&k, rec, fn, kind, args, n);
    if (ok <= 0) {
        if (ok == 0)
            result = miss();
        goto out;
    }
    key = key_tuple(&k);
    if (key == NULL)
        goto out;
    PyObject *entry = PyDict_GetItemWithError(table, key); /* borrowed */
    if (entry == NULL) {
        if (!PyErr_Occurred())
            result = miss();
        goto out;
    }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) < 3 || PyTuple_GET_SIZE(entry) > 4) {
        PyErr_SetString(PyExc_TypeError,
                        "autobatch fast entry is not (recorder, outs, wrap[, log])");
        goto out;
    }
    Py_INCREF(entry); /* the recorder may run Python that changes the table */
    if (k.number != NULL) {
        PyObject *item = PyObject_CallMethodNoArgs(k.number, s_item);
        if (item == NULL) {
            Py_DECREF(entry);
            goto out;
        }
        k.nodes[k.nn++] = item; /* owned, released with the key */
    }
    PyObject *res = PyObject_Vectorcall(PyTuple_GET_ITEM(entry, 0), k.nodes, k.nn, NULL);
    result = res == NULL ? NULL : emit(entry, res, rec);
    if (result != NULL && note_call(&k, rec, fn, kind) < 0)
        Py_CLEAR(result);
    if (result != NULL && PyTuple_GET_SIZE(entry) == 4 && log_view(entry, rec, result, args, n) < 0)
        Py_CLEAR(result);
    Py_DECREF(entry);
out:
    Py_XDECREF(key);
    Py_XDECREF(table);
    key_release(&k);
    return result;
}

/* fast_key(rec, fn, kind, args): the key fast() looks this call up by, or None where the call
   has none; the slow path files the op's entry under it. */
static PyObject *
fast_key(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyTuple_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "fast_key(rec, fn, kind, args: tuple)");
        return NULL;
    }
    Key k;
    int ok = key_build(&k, args[0], args[1], args[2], &PyTuple_GET_ITEM(args[3], 0),
                       PyTuple_GET_SIZE(args[3]));
    if (ok <= 0) {
        key_release(&k);
        if (ok < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *key = key_tuple(&k);
    key_release(&k);
    return key;
}

static PyObject *fast_now(PyObject *rec, PyObject *fn, PyObject *kind, PyObject *const *args,
                          Py_ssize_t n);

static PyObject *
fast(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyTuple_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "fast(rec, fn, kind, args: tuple)");
        return NULL;
    }
    /* The table of the mode on now: a module call recorded under torch.no_grad() comes
       here from the slow path's entry and finds the table its first call filled. */
    return fast_now(args[0], args[1], args[2], &PyTuple_GET_ITEM(args[3], 0),
                    PyTuple_GET_SIZE(args[3]));
}

/* The fast table for the grad/autocast mode on now: the recorder's ``_fast`` where gradients
   are on and no autocast region is, its ``_fast_nograd`` where gradients are off (inference,
   decoding under torch.no_grad()) and no autocast region is; NULL (no error) in any other
   mode, and with an error set on error.  Borrowed: an interned name. */
static PyObject *
mode_table(void)
{
    PyObject *v = PyObject_CallNoArgs(g_any_autocast);
    if (v == NULL)
        return NULL;
    int cast = v != Py_False;
    Py_DECREF(v);
    if (cast)
        return NULL;
    v = PyObject_CallNoArgs(g_grad_enabled);
    if (v == NULL)
        return NULL;
    int on = v == Py_True;
    Py_DECREF(v);
    return on ? s_fast : s_fast_nograd;
}

/* The recorder of the autobatch call recording on this thread, where a batchable call
   records now (not paused, no batched function running); NULL with no error where none. */
static PyObject *
current_recorder(void)
{
    if (!configured())
        return NULL;
    PyObject *rec = PyObject_GetAttr(g_local, s_rec);
    if (rec == NULL || rec == Py_None) {
        Py_XDECREF(rec);
        return NULL;
    }
    PyObject *v = PyObject_GetAttr(rec, s_paused);
    int paused = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    if (paused == 0) {
        v = PyObject_GetAttr(g_local, s_running);
        paused = v == NULL ? -1 : PyObject_IsTrue(v);
        Py_XDECREF(v);
    }
    if (paused != 0) {
        Py_DECREF(rec);
        return NULL;
    }
    return rec;
}

/* The fast path of a call recorded by ``rec`` (NULL: the recorder of the autobatch call
   recording on this thread, if one records now) in the mode the fast table is for: the
   outputs, _MISS (a new reference) where there is no recorder, another mode is on, or the
   fast path misses, NULL on error. */
static PyObject *
fast_now(PyObject *rec, PyObject *fn, PyObject *kind, PyObject *const *args, Py_ssize_t n)
{
    if (rec == NULL) {
        rec = current_recorder();
        if (rec == NULL)
            return PyErr_Occurred() ? NULL : miss();
    }
    else
        Py_INCREF(rec);
    PyObject *table = mode_table();
    PyObject *out = table != NULL ? fast_impl(rec, fn, kind, args, n, table)
                    : PyErr_Occurred() ? NULL
                                       : miss();
    Py_DECREF(rec);
    return out;
}

/* ------------------------------------------------------------------------- batchable */

typedef struct {
    PyObject_HEAD
    PyObject *fn;
    PyObject *kind;
} BatchableBase;

static int
batchable_traverse(BatchableBase *self, visitproc visit, void *arg)
{
    Py_VISIT(self->fn);
    Py_VISIT(self->kind);
    return 0;
}

static int
batchable_clear(BatchableBase *self)
{
    Py_CLEAR(self->fn);
    Py_CLEAR(self->kind);
    return 0;
}

static void
batchable_dealloc(BatchableBase *self)
{
    PyObject_GC_UnTrack(self);
    batchable_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
batchable_call(BatchableBase *self, PyObject *args, PyObject *kwargs)
{
    if (self->fn != NULL && self->fn != Py_None && self->kind != NULL &&
        self->kind != Py_None && (kwargs == NULL || PyDict_GET_SIZE(kwargs) == 0)) {
        PyObject *out = fast_now(NULL, self->fn, self->kind, &PyTuple_GET_ITEM(args, 0),
                                 PyTuple_GET_SIZE(args));
        if (out != g_miss)
            return out;
        Py_DECREF(out);
    }
    PyObject *slow = PyObject_GetAttr((PyObject *)self, s_call);
    if (slow == NULL)
        return NULL;
    PyObject *out = PyObject_Call(slow, args, kwargs);
    Py_DECREF(slow);
    return out;
}

static PyObject *
bind(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, obj);
}

static PyMemberDef batchable_members[] = {
    {"fn", T_OBJECT, offsetof(BatchableBase, fn), 0, "the decorated function"},
    {"_kind", T_OBJECT, offsetof(BatchableBase, kind), 0, "the kind its calls record as"},
    {NULL},
};

static PyTypeObject BatchableBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fold._clazy.BatchableBase",
    .tp_doc = PyDoc_STR("The call and descriptor of fold.batchable (see fold.autobatch)."),
    .tp_basicsize = sizeof(BatchableBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)batchable_dealloc,
    .tp_traverse = (traverseproc)batchable_traverse,
    .tp_clear = (inquiry)batchable_clear,
    .tp_call = (ternaryfunc)batchable_call,
    .tp_descr_get = bind,
    .tp_members = batchable_members,
};

/* ------------------------------------------------------------------------- Method */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *func;
} Method;

static PyObject *
kwargs_of(PyObject *const *values, PyObject *kwnames)
{
    PyObject *d = PyDict_New();
    if (d == NULL || kwnames == NULL)
        return d;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++)
        if (PyDict_SetItem(d, PyTuple_GET_ITEM(kwnames, i), values[i]) < 0) {
            Py_DECREF(d);
            return NULL;
        }
    return d;
}

/* Whether ``a`` is a plain argument of a method of an earlier round's value (the slow
   path's _PLAIN: an int, float, bool, None, slice or Ellipsis, or a tuple of them). */
static int
plain_arg(PyObject *a, int nested)
{
    if (PyLong_CheckExact(a) || PyFloat_CheckExact(a) || PyBool_Check(a) || a == Py_None ||
        PySlice_Check(a) || a == Py_Ellipsis)
        return 1;
    if (!nested && PyTuple_CheckExact(a)) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(a); i++)
            if (!plain_arg(PyTuple_GET_ITEM(a, i), 1))
                return 0;
        return 1;
    }
    return 0;
}

/* A plain argument as a memo key part, as values._memo_part makes it (a new reference): an
   int, None or Ellipsis itself, (bool, b), (float, its bits), (slice, start, stop, step),
   (tuple, items...) (not nested); _MISS where it is not keyed, NULL on error. */
static PyObject *
memo_part(PyObject *a, int nested)
{
    if (PyLong_CheckExact(a) || a == Py_None || a == Py_Ellipsis) {
        Py_INCREF(a);
        return a;
    }
    if (PyBool_Check(a))
        return PyTuple_Pack(2, (PyObject *)&PyBool_Type, a);
    if (PyFloat_CheckExact(a)) {
        double d = PyFloat_AS_DOUBLE(a);
        long long bits;
        memcpy(&bits, &d, sizeof bits);
        PyObject *b = PyLong_FromLongLong(bits);
        if (b == NULL)
            return NULL;
        PyObject *t = PyTuple_Pack(2, (PyObject *)&PyFloat_Type, b);
        Py_DECREF(b);
        return t;
    }
    int slice = PySlice_Check(a);
    if (!slice && (nested || !PyTuple_CheckExact(a)))
        return miss();
    Py_ssize_t k = slice ? 3 : PyTuple_GET_SIZE(a);
    PyObject *out = PyTuple_New(k + 1);
    if (out == NULL)
        return NULL;
    PyObject *head = slice ? (PyObject *)&PySlice_Type : (PyObject *)&PyTuple_Type;
    Py_INCREF(head);
    PyTuple_SET_ITEM(out, 0, head);
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *x = slice ? (i == 0   ? ((PySliceObject *)a)->start
                               : i == 1 ? ((PySliceObject *)a)->stop
                                        : ((PySliceObject *)a)->step)
                            : PyTuple_GET_ITEM(a, i);
        PyObject *p = memo_part(x, 1);
        if (p == NULL || p == g_miss) {
            Py_DECREF(out);
            return p;
        }
        PyTuple_SET_ITEM(out, i + 1, p);
    }
    return out;
}

/* The memo key of ``func`` on ``row``, the row of lazy value ``x``, with plain arguments
   ``args`` (as values._memo_key: func, recorder, node, the row's version, the grad mode,
   the arguments' parts); _MISS where an argument is not keyed, NULL on error. */
static PyObject *
memo_key(PyObject *func, PyObject *x, PyObject *row, PyObject *const *args, Py_ssize_t n)
{
    PyObject *key = PyTuple_New(5 + n);
    if (key == NULL)
        return NULL;
    /* As values._memo_key: under inference mode (grad off, first) no version; else the
       row's, None for an inference tensor (values.version_of). */
    PyObject *grad = PyObject_CallNoArgs(g_grad_enabled);
    PyObject *version = NULL;
    if (grad == Py_False) {
        PyObject *inference = PyObject_CallNoArgs(g_inference_enabled);
        if (inference != NULL)
            version = inference == Py_True ? Py_NewRef(Py_None) : row_version(row);
        Py_XDECREF(inference);
    }
    else if (grad != NULL)
        version = row_version(row);
    if (version == NULL) {
        Py_XDECREF(grad);
        Py_DECREF(key);
        return NULL;
    }
    PyObject *head[3] = {func, LAZY(x)->rec, LAZY(x)->node};
    for (int i = 0; i < 3; i++) {
        Py_INCREF(head[i]);
        PyTuple_SET_ITEM(key, i, head[i]);
    }
    PyTuple_SET_ITEM(key, 3, version);
    PyTuple_SET_ITEM(key, 4, grad);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = memo_part(args[i], 0);
        if (p == NULL || p == g_miss) {
            Py_DECREF(key);
            return p;
        }
        PyTuple_SET_ITEM(key, 5 + i, p);
    }
    return key;
}

/* ``func(*stack)`` (``stack[0]`` the row of lazy value ``x``, then plain arguments) memoised
   in ``session``'s memo, as values._memoised does it. */
static PyObject *
memo_call(PyObject *func, PyObject *x, PyObject *const *stack, Py_ssize_t n, PyObject *session)
{
    PyObject *v = PyObject_CallNoArgs(g_any_autocast);
    if (v == NULL)
        return NULL;
    int cast = v != Py_False;
    Py_DECREF(v);
    PyObject *key = cast ? miss() : memo_key(func, x, stack[0], stack + 1, n - 1);
    if (key == NULL)
        return NULL;
    if (key == g_miss) {
        Py_DECREF(key);
        return PyObject_Vectorcall(func, stack, n, NULL);
    }
    PyObject *memo = PyObject_GetAttr(session, s_memo);
    PyObject *out = NULL;
    if (memo == NULL || !PyDict_CheckExact(memo)) {
        if (memo != NULL)
            PyErr_SetString(PyExc_TypeError, "autobatch session's memo is not a dict");
        goto done;
    }
    out = PyDict_GetItemWithError(memo, key);
    if (out != NULL || PyErr_Occurred()) {
        if (out == NULL)
            goto done;
        /* A view is the value itself, as eager views of one slice share its memory; any
           other result a value of its own on the same node (as values._memoised): an
           in-place change of one must not reach the others. */
        int view = PySet_Contains(g_memo_views, func);
        if (view < 0)
            out = NULL;
        else if (view)
            Py_INCREF(out);
        else
            out = new_lazy(LAZY(out)->node, LAZY(out)->meta, LAZY(out)->rec);
        goto done;
    }
    out = PyObject_Vectorcall(func, stack, n, NULL);
    if (out != NULL && (PyObject *)Py_TYPE(out) == g_tensor_type)
        Py_SETREF(out, PyObject_CallFunctionObjArgs(g_memo_wrap, LAZY(x)->rec, out, key, memo,
                                                    x, NULL));
done:
    Py_XDECREF(memo);
    Py_DECREF(key);
    return out;
}

/* Whether ``out``, the result of ``func`` run at once on ``conv`` (the rows of earlier
   rounds' values among them), may share memory with one of them: one of them itself, a
   view (it has a base), ``detach``'s alias, or anything under inference mode (whose views
   keep no base).  1, 0, -1 on error. */
static int
may_share(PyObject *func, PyObject *out, PyObject *const *conv, Py_ssize_t n)
{
    if (func == g_detach)
        return 1;
    int many = PyTuple_CheckExact(out) || PyList_CheckExact(out);
    Py_ssize_t k = many ? PySequence_Fast_GET_SIZE(out) : 1;
    int tensors = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *o = many ? PySequence_Fast_GET_ITEM(out, j) : out;
        if (!PyObject_TypeCheck(o, (PyTypeObject *)g_tensor_type))
            continue;
        tensors = 1;
        for (Py_ssize_t i = 0; i < n; i++)
            if (o == conv[i])
                return 1;
        PyObject *base = PyObject_GetAttr(o, s_base);
        if (base == NULL)
            return -1;
        Py_DECREF(base);
        if (base != Py_None)
            return 1;
    }
    if (!tensors || g_inference_enabled == NULL)
        return 0;
    PyObject *v = PyObject_CallNoArgs(g_inference_enabled);
    if (v == NULL)
        return -1;
    Py_DECREF(v);
    return v == Py_True;
}

/* values._mark_shared(args, out) where ``out``, the result of ``func`` run at once on
   ``conv`` (``args`` converted: lazy values of earlier rounds their rows), may share memory
   with a lazy value among ``args``: ``out`` is noted among that value's tensors, and an
   in-place change of the value refused while ``out`` lives (eager code would change it
   too).  0, or -1 on error. */
static int
note_shared(PyObject *func, PyObject *out, PyObject *const *args, PyObject *const *conv,
            Py_ssize_t n)
{
    if (g_note_shared == NULL)
        return 0;
    int may = may_share(func, out, conv, n);
    if (may <= 0)
        return may;
    PyObject *given = PyTuple_New(n);
    if (given == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(given, i, args[i]);
    }
    PyObject *r = PyObject_CallFunctionObjArgs(g_note_shared, given, out, NULL);
    Py_DECREF(given);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *session_row(PyObject *a, PyObject *session);

/* A method of an earlier round's value whose other arguments are plain (``enc[i]``, a
   parser's encoder rows at every step), called inside the autobatch call that made it
   while a later round records or the examples finish eagerly: as the slow path's
   _record_method, the method on the value's row at once (memoised where it is pure, see
   memo_call), the row made where it was not read before (session_row, as _value_of).
   _MISS (a new reference) where that does not apply (the slow path takes it), NULL on
   error. */
static PyObject *
earlier_method(PyObject *func, PyObject *const *args, Py_ssize_t n)
{
    PyObject *old = LAZY(args[0])->rec;
    if (n > MAX_FAST)
        return miss();
    for (Py_ssize_t i = 1; i < n; i++)
        if (!plain_arg(args[i], 0))
            return miss();
    PyObject *session = PyObject_GetAttr(old, s_session);
    PyObject *cur = session && session != Py_None ? PyObject_GetAttr(session, s_current) : NULL;
    PyObject *local = cur ? PyObject_GetAttr(g_local, s_rec) : NULL;
    int ok = local != NULL && cur != Py_None && cur == local && cur != old;
    Py_XDECREF(cur);
    Py_XDECREF(local);
    PyObject *row = ok ? session_row(args[0], session) : NULL;
    int pure = row != NULL && row != g_miss && g_pure != NULL ? PySet_Contains(g_pure, func) : 0;
    PyObject *out = NULL;
    if (row == NULL || row == g_miss || pure < 0) {
        out = PyErr_Occurred() ? NULL : miss();
    }
    else {
        PyObject *stack[MAX_FAST];
        stack[0] = row;
        for (Py_ssize_t i = 1; i < n; i++)
            stack[i] = args[i];
        out = pure ? memo_call(func, args[0], stack, n, session)
                   : PyObject_Vectorcall(func, stack, n, NULL);
        if (!pure && out != NULL && note_shared(func, out, args, stack, n) < 0)
            Py_CLEAR(out);
    }
    Py_XDECREF(session);
    Py_XDECREF(row);
    return out;
}

/* The session of the autobatch call recording on this thread where its examples finish as
   eager code (a new reference); NULL where none does (with an error set on error). */
static PyObject *
eager_session(void)
{
    PyObject *rec = PyObject_GetAttr(g_local, s_rec);
    if (rec == NULL || rec == Py_None) {
        Py_XDECREF(rec);
        return NULL;
    }
    PyObject *session = PyObject_GetAttr(rec, s_session);
    Py_DECREF(rec);
    if (session == NULL || session == Py_None) {
        Py_XDECREF(session);
        return NULL;
    }
    PyObject *v = PyObject_GetAttr(session, s_eager);
    int eager = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    if (eager != 1) {
        Py_DECREF(session);
        return NULL;
    }
    return session;
}

/* The row of a lazy value of an earlier round of ``session``'s call (a new reference), as
   values._value_of makes it and keeps it (its recorder's rows_of); _MISS where it is of
   another call or its round has not run (the slow path says so), NULL on error. */
static PyObject *
session_row(PyObject *a, PyObject *session)
{
    PyObject *old = LAZY(a)->rec, *node = LAZY(a)->node;
    if (old == NULL || node == NULL || LAZY(a)->meta == NULL)
        return miss();
    PyObject *mine = PyObject_GetAttr(old, s_session);
    if (mine == NULL)
        return NULL;
    int same = mine == session;
    Py_DECREF(mine);
    if (!same)
        return miss();
    PyObject *rows = PyObject_GetAttr(old, s_rows_of);
    if (rows == NULL)
        return NULL;
    if (!PyDict_CheckExact(rows)) {
        Py_DECREF(rows);
        return miss();
    }
    PyObject *row = PyDict_GetItemWithError(rows, node);
    if (row != NULL || PyErr_Occurred()) {
        Py_XINCREF(row);
        Py_DECREF(rows);
        return row;
    }
    PyObject *values = PyObject_GetAttr(old, s_values);
    PyObject *entry = values && PyDict_CheckExact(values) ? PyDict_GetItemWithError(values, node)
                                                          : NULL;
    if (entry == NULL || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2) {
        Py_XDECREF(values);
        Py_DECREF(rows);
        return PyErr_Occurred() ? NULL : miss();
    }
    Py_INCREF(entry);
    Py_DECREF(values);
    /* as values._value_of: its recorder's row_of */
    row = PyObject_CallMethodObjArgs(old, s_row_of, PyTuple_GET_ITEM(entry, 0),
                                     PyTuple_GET_ITEM(entry, 1), NULL);
    Py_DECREF(entry);
    if (row != NULL && PyDict_SetItem(rows, node, row) < 0)
        Py_CLEAR(row);
    Py_DECREF(rows);
    return row;
}

/* One argument of a call of the eager finish of ``session``'s examples, as
   values._eager_value makes it (a new reference): a lazy value of the call its row, a
   tensor or plain value as it is, a list or tuple (not nested) of those converted alike;
   _MISS where the slow path must say (a known value, a lazy value of another call, deeper
   lists), NULL on error. */
static PyObject *
eager_arg(PyObject *a, PyObject *session, int nested)
{
    if ((PyObject *)Py_TYPE(a) == g_lazy_type)
        return session_row(a, session);
    if (plain_arg(a, 0) || PyObject_TypeCheck(a, (PyTypeObject *)g_tensor_type)) {
        Py_INCREF(a);
        return a;
    }
    int list = PyList_CheckExact(a);
    if (nested || !(list || PyTuple_CheckExact(a)))
        return miss();
    Py_ssize_t k = list ? PyList_GET_SIZE(a) : PyTuple_GET_SIZE(a);
    PyObject *out = list ? PyList_New(k) : PyTuple_New(k);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *x = eager_arg(list ? PyList_GET_ITEM(a, i) : PyTuple_GET_ITEM(a, i), session, 1);
        if (x == NULL || x == g_miss) {
            Py_DECREF(out);
            return x;
        }
        if (list)
            PyList_SET_ITEM(out, i, x);
        else
            PyTuple_SET_ITEM(out, i, x);
    }
    return out;
}

/* ``func`` on ``args`` (``first`` before them where not NULL: a module) with every argument
   converted by eager_arg for ``session``; _MISS where one needs the slow path. */
static PyObject *
eager_call_now(PyObject *func, PyObject *first, PyObject *const *args, Py_ssize_t n,
               PyObject *session)
{
    PyObject *stack[MAX_FAST + 1];
    Py_ssize_t made = 0, at = first != NULL;
    PyObject *out = NULL;
    if (n > MAX_FAST)
        return miss();
    stack[0] = first;
    for (; made < n; made++) {
        PyObject *x = eager_arg(args[made], session, 0);
        if (x == NULL || x == g_miss) {
            out = x;
            goto done;
        }
        stack[at + made] = x;
    }
    out = PyObject_Vectorcall(func, stack, at + n, NULL);
    if (out != NULL && note_shared(func, out, args, stack + at, n) < 0)
        Py_CLEAR(out);
done:
    for (Py_ssize_t i = 0; i < made; i++)
        Py_DECREF(stack[at + i]);
    return out;
}

/* ``func`` on ``args`` as eager code where the examples of the call recording on this
   thread finish so (driver._Session): lazy values of the call as their rows, tensors and
   plain values as they are, in lists and tuples too (eager_arg); _MISS where the examples
   do not, or an argument needs the slow path (a known value).  Every call of the eager
   finish that reaches a lazy value comes here (a decoder's memory at each step: ``mem @
   q``, ``weights @ mem``; ``torch.cat([h, ctx])``) instead of the Python recorder's. */
static PyObject *
eager_now(PyObject *func, PyObject *const *args, Py_ssize_t n)
{
    if (n > MAX_FAST)
        return miss();
    PyObject *session = eager_session();
    if (session == NULL)
        return PyErr_Occurred() ? NULL : miss();
    PyObject *out = eager_call_now(func, NULL, args, n, session);
    Py_DECREF(session);
    return out;
}

/* ``func`` on ``args`` at once where every lazy value among them (in lists and tuples too)
   is of an earlier round of the call recording on this thread, as the slow path's
   recorder._computed runs it (``torch.cat([enc[s0], enc[s1], enc[b0]])`` of a parser's
   encoder rows: eager code on their rows); _MISS where that does not apply (no round has
   run, a value of the round recording now, a known value: the slow path says), NULL on
   error. */
static PyObject *
earlier_now(PyObject *rec, PyObject *func, PyObject *const *args, Py_ssize_t n)
{
    if (n > MAX_FAST)
        return miss();
    PyObject *session = PyObject_GetAttr(rec, s_session);
    PyObject *out = NULL;
    if (session == NULL)
        goto done;
    if (session == Py_None) {
        out = miss();
        goto done;
    }
    PyObject *cur = PyObject_GetAttr(session, s_current);
    PyObject *rounds = cur ? PyObject_GetAttr(session, s_rounds) : NULL;
    int started = rounds == NULL ? -1 : PyObject_IsTrue(rounds);
    int current = cur == rec;
    Py_XDECREF(rounds);
    Py_XDECREF(cur);
    if (started < 0)
        goto done;
    out = started && current ? eager_call_now(func, NULL, args, n, session) : miss();
done:
    Py_XDECREF(session);
    return out;
}

static PyObject *g_kw_defaults; /* fold.autobatch.values._KW_DEFAULTS (configure_defaults) */
static PyObject *g_inline;      /* fold.autobatch.recorder._INLINE (configure_inline) */
static PyObject *g_positional;  /* fold.autobatch.values._POSITIONAL (configure_defaults) */
static PyObject *g_fills;       /* fold.autobatch.values._FILLS (configure_defaults) */

/* A number, a string, None or a bool: a keyword value that may be passed by position. */
static inline int
constant_value(PyObject *v)
{
    return v == Py_None || PyBool_Check(v) || PyLong_CheckExact(v) || PyFloat_CheckExact(v) ||
           PyUnicode_CheckExact(v);
}

/* The call ``func(*args, **{names[i]: values[i]})`` as the fast path takes it, without
   keywords, as values._given makes it: each keyword that passes its parameter's default
   (values._KW_DEFAULTS) dropped, and the others, numbers, strings or None, put after
   ``args`` at their parameters' places (values._POSITIONAL), each parameter between them
   given its default (values._FILLS): ``F.relu(x)`` reaches here with inplace=False,
   ``x.sum(dim=0)`` as ``sum(x, dim=0)``, made ``sum(x, 0)``; ``x.clamp(max=1)`` made
   ``clamp(x, None, 1)``.  ``out`` gets ``args`` and those (borrowed); the count, or 0
   where some keyword stays one (or ``func`` was not seen yet: the slow path fills its
   entries), -1 on error. */
static Py_ssize_t
positional_call(PyObject *func, PyObject *const *args, Py_ssize_t n, PyObject *const *names,
                PyObject *const *values, Py_ssize_t nkw, PyObject **out)
{
    if (g_kw_defaults == NULL || g_positional == NULL || g_fills == NULL || nkw > MAX_FAST ||
        n > MAX_FAST)
        return 0;
    PyObject *defaults = PyDict_GetItemWithError(g_kw_defaults, func); /* borrowed */
    if (defaults == NULL || !PyDict_CheckExact(defaults))
        return PyErr_Occurred() ? -1 : 0;
    int kept[MAX_FAST];
    Py_ssize_t left = 0;
    for (Py_ssize_t j = 0; j < nkw; j++) {
        PyObject *d = PyDict_GetItemWithError(defaults, names[j]); /* borrowed */
        if (d == NULL && PyErr_Occurred())
            return -1;
        int dropped = 0;
        if (d != NULL) {
            if (values[j] == d)
                dropped = 1;
            else if (Py_TYPE(values[j]) == Py_TYPE(d)) {
                dropped = PyObject_RichCompareBool(values[j], d, Py_EQ);
                if (dropped < 0)
                    return -1;
            }
        }
        kept[j] = !dropped;
        left += !dropped;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = args[i];
    Py_ssize_t m = n;
    if (left) {
        PyObject *order = PyDict_GetItemWithError(g_positional, func); /* borrowed */
        if (order == NULL || !PyTuple_CheckExact(order))
            return PyErr_Occurred() ? -1 : 0;
        PyObject *fills = PyDict_GetItemWithError(g_fills, func); /* borrowed */
        if (fills == NULL || !PyDict_CheckExact(fills))
            return PyErr_Occurred() ? -1 : 0;
        for (Py_ssize_t i = n; i < PyTuple_GET_SIZE(order) && left && m < MAX_FAST; i++) {
            PyObject *name = PyTuple_GET_ITEM(order, i);
            Py_ssize_t at = -1;
            for (Py_ssize_t j = 0; j < nkw && at < 0; j++)
                if (kept[j] && (names[j] == name || PyUnicode_Compare(names[j], name) == 0))
                    at = j;
            if (at >= 0) {
                if (!constant_value(values[at]))
                    break;
                kept[at] = 0;
                left--;
                out[m++] = values[at];
                continue;
            }
            /* Not given (or given as its default): its default, for a later one given,
               where values._FILLS has it. */
            PyObject *d = PyDict_GetItemWithError(fills, name); /* borrowed */
            if (d == NULL)
                break;
            out[m++] = d;
        }
        if (PyErr_Occurred())
            return -1;
    }
    return left ? 0 : m;
}

/* positional_call of a call whose keywords are a dict. */
static Py_ssize_t
positional_dict(PyObject *func, PyObject *const *args, Py_ssize_t n, PyObject *kw,
                PyObject **out)
{
    Py_ssize_t nkw = PyDict_GET_SIZE(kw);
    if (nkw > MAX_FAST)
        return 0;
    PyObject *names[MAX_FAST], *values[MAX_FAST];
    Py_ssize_t pos = 0, j = 0;
    PyObject *k, *v;
    while (PyDict_Next(kw, &pos, &k, &v)) {
        if (!PyUnicode_Check(k))
            return 0;
        names[j] = k;
        values[j++] = v;
    }
    return positional_call(func, args, n, names, values, nkw, out);
}

static PyObject *
method_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Method *self = (Method *)op;
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (!configured())
        return NULL;
    PyObject *const *call = kwnames == NULL ? args : NULL;
    Py_ssize_t m = n;
    PyObject *given[2 * MAX_FAST];
    if (kwnames != NULL && n >= 1 && PyObject_TypeCheck(args[0], &LazyBaseType) &&
        LAZY(args[0])->rec != NULL) {
        /* x.sum(dim=0) as x.sum(0) (see positional_call) */
        m = positional_call(self->func, args, n, &PyTuple_GET_ITEM(kwnames, 0), args + n,
                            PyTuple_GET_SIZE(kwnames), given);
        if (m < 0)
            return NULL;
        if (m > 0)
            call = given;
    }
    PyObject *const *as_called = args; /* (the slow path below takes the call as made) */
    Py_ssize_t n_called = n;
    if (call != NULL && m >= 1 && PyObject_TypeCheck(args[0], &LazyBaseType) &&
        LAZY(args[0])->rec != NULL) {
        args = call;
        n = m;
        PyObject *out = earlier_method(self->func, args, n);
        if (out != g_miss)
            return out;
        Py_DECREF(out);
        out = fast_now(LAZY(args[0])->rec, self->func, g_torch_kind, args, n);
        if (out != g_miss)
            return out;
        Py_DECREF(out);
        /* A value of an earlier round (``mem @ q`` with a decoder's memory at every step):
           the recorder of the round recording now holds the entry, as the slow path
           records it there. */
        PyObject *cur = current_recorder();
        if (cur == NULL && PyErr_Occurred())
            return NULL;
        if (cur != NULL && cur != LAZY(args[0])->rec) {
            out = fast_now(cur, self->func, g_torch_kind, args, n);
            Py_DECREF(cur);
            if (out != g_miss)
                return out;
            Py_DECREF(out);
        }
        else
            Py_XDECREF(cur);
        out = eager_now(self->func, args, n);
        if (out != g_miss)
            return out;
        Py_DECREF(out);
        args = as_called;
        n = n_called;
    }
    PyObject *targs = PyTuple_New(n);
    if (targs == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(targs, i, args[i]);
    }
    PyObject *kw = kwargs_of(args + n, kwnames);
    PyObject *out = NULL;
    if (kw != NULL)
        out = PyObject_CallFunctionObjArgs(g_slow_method, self->func, targs, kw, NULL);
    Py_DECREF(targs);
    Py_XDECREF(kw);
    return out;
}

static PyObject *
method_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *func;
    if (!PyArg_ParseTuple(args, "O", &func))
        return NULL;
    Method *self = (Method *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(func);
    self->func = func;
    self->vectorcall = method_vectorcall;
    return (PyObject *)self;
}

static int
method_traverse(Method *self, visitproc visit, void *arg)
{
    Py_VISIT(self->func);
    return 0;
}

static int
method_clear(Method *self)
{
    Py_CLEAR(self->func);
    return 0;
}

static void
method_dealloc(Method *self)
{
    PyObject_GC_UnTrack(self);
    method_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
method_name(Method *self, void *closure)
{
    return PyObject_GetAttrString(self->func, "__name__");
}

static PyGetSetDef method_getset[] = {
    {"__name__", (getter)method_name, NULL, NULL, NULL},
    {"__qualname__", (getter)method_name, NULL, NULL, NULL},
    {NULL},
};

static PyMemberDef method_members[] = {
    {"func", T_OBJECT, offsetof(Method, func), READONLY, "the torch.Tensor method recorded"},
    {NULL},
};

static PyTypeObject MethodType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fold._clazy.Method",
    .tp_doc = PyDoc_STR("Method(func): a tensor method or operator of a lazy value, recorded."),
    .tp_basicsize = sizeof(Method),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = method_new,
    .tp_dealloc = (destructor)method_dealloc,
    .tp_traverse = (traverseproc)method_traverse,
    .tp_clear = (inquiry)method_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Method, vectorcall),
    .tp_descr_get = bind,
    .tp_getset = method_getset,
    .tp_members = method_members,
};

/* ------------------------------------------------------------------------- ModuleCall */

/* ModuleCall(inner, token, patches, eager_call): what autobatch installs as
   nn.Module.__call__ for the length of a call (fold/autobatch/patches.py, whose Python
   wrapper it mirrors, branch for branch).  A module call passes through to ``inner`` where
   no autobatch call records on this thread, its recorder is paused, or another wrapper
   took this one's place (``patches.token`` is not ``token``); where the call's examples
   finish as eager code, it passes through too unless an argument needs converting (a lazy
   or known value, a list or tuple, keywords: ``eager_call`` converts them); else the call
   is recorded: the C fast path first, then ``rec.record(module, "module", args, kwargs)``. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *inner;
    PyObject *token;
    PyObject *patches;
    PyObject *eager_call;
} ModuleCall;

static int
converted(PyObject *a)
{
    PyObject *t = (PyObject *)Py_TYPE(a);
    return t == g_lazy_type || t == g_known_type || PyList_CheckExact(a) || PyTuple_CheckExact(a);
}

static PyObject *
module_call_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    ModuleCall *self = (ModuleCall *)op;
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (n < 1 || !configured())
        goto pass;
    PyObject *rec = PyObject_GetAttr(g_local, s_rec);
    if (rec == NULL)
        return NULL;
    if (rec == Py_None) {
        Py_DECREF(rec);
        goto pass;
    }
    PyObject *v = PyObject_GetAttr(rec, s_paused);
    int paused = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    PyObject *tok = paused == 0 ? PyObject_GetAttr(self->patches, s_token) : NULL;
    if (paused != 0 || tok == NULL || tok != self->token) {
        Py_DECREF(rec);
        if (paused < 0 || (paused == 0 && tok == NULL))
            return NULL;
        Py_XDECREF(tok);
        goto pass;
    }
    Py_DECREF(tok);
    PyObject *session = PyObject_GetAttr(rec, s_session);
    if (session == NULL) {
        Py_DECREF(rec);
        return NULL;
    }
    int eager = 0;
    if (session != Py_None) {
        v = PyObject_GetAttr(session, s_eager);
        eager = v == NULL ? -1 : PyObject_IsTrue(v);
        Py_XDECREF(v);
    }
    if (eager < 0) {
        Py_DECREF(session);
        Py_DECREF(rec);
        return NULL;
    }
    if (eager) { /* the examples finish as eager code */
        Py_DECREF(rec);
        int plain = kwnames == NULL;
        for (Py_ssize_t i = 1; plain && i < n; i++)
            plain = !converted(args[i]);
        if (plain) {
            Py_DECREF(session);
            goto pass;
        }
        PyObject *out = kwnames == NULL && !in_place_module(args[0])
                            ? eager_call_now(self->inner, args[0], args + 1, n - 1, session)
                            : miss();
        Py_DECREF(session);
        if (out != g_miss)
            return out;
        Py_DECREF(out);
        return PyObject_Vectorcall(self->eager_call, args, nargsf, kwnames);
    }
    Py_DECREF(session);
    if (g_inline != NULL && PyDict_GET_SIZE(g_inline)) {
        /* A module whose calls are run through (recorder._INLINE: its forward's calls
           recorded, as the slow path's _record runs it at once): no key to build. */
        PyObject *id = PyLong_FromVoidPtr(args[0]);
        PyObject *found = id == NULL ? NULL : PyDict_GetItemWithError(g_inline, id);
        Py_XDECREF(id);
        if (found == NULL && PyErr_Occurred()) {
            Py_DECREF(rec);
            return NULL;
        }
        if (found == args[0]) {
            Py_DECREF(rec);
            goto pass;
        }
    }
    if (kwnames == NULL && n - 1 > 0 && n - 1 <= MAX_FAST) {
        PyObject *out = fast_now(rec, args[0], s_module_kind, args + 1, n - 1);
        if (out != g_miss) {
            Py_DECREF(rec);
            return out;
        }
        Py_DECREF(out);
    }
    PyObject *targs = PyTuple_New(n - 1);
    PyObject *kw = targs ? kwargs_of(args + n, kwnames) : NULL;
    PyObject *out = NULL;
    if (kw != NULL) {
        for (Py_ssize_t i = 1; i < n; i++) {
            Py_INCREF(args[i]);
            PyTuple_SET_ITEM(targs, i - 1, args[i]);
        }
        PyObject *rargs[5] = {rec, args[0], s_module_kind, targs, kw};
        out = PyObject_VectorcallMethod(s_record, rargs, 5, NULL);
    }
    Py_XDECREF(targs);
    Py_XDECREF(kw);
    Py_DECREF(rec);
    return out;
pass:
    if (PyErr_Occurred())
        return NULL;
    return PyObject_Vectorcall(self->inner, args, nargsf, kwnames);
}

static PyObject *
module_call_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *inner, *token, *patches, *eager_call;
    if (!PyArg_ParseTuple(args, "OOOO", &inner, &token, &patches, &eager_call))
        return NULL;
    ModuleCall *self = (ModuleCall *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(inner);
    Py_INCREF(token);
    Py_INCREF(patches);
    Py_INCREF(eager_call);
    self->inner = inner;
    self->token = token;
    self->patches = patches;
    self->eager_call = eager_call;
    self->vectorcall = module_call_vectorcall;
    return (PyObject *)self;
}

static int
module_call_traverse(ModuleCall *self, visitproc visit, void *arg)
{
    Py_VISIT(self->inner);
    Py_VISIT(self->token);
    Py_VISIT(self->patches);
    Py_VISIT(self->eager_call);
    return 0;
}

static int
module_call_clear(ModuleCall *self)
{
    Py_CLEAR(self->inner);
    Py_CLEAR(self->token);
    Py_CLEAR(self->patches);
    Py_CLEAR(self->eager_call);
    return 0;
}

static void
module_call_dealloc(ModuleCall *self)
{
    PyObject_GC_UnTrack(self);
    module_call_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
module_call_name(ModuleCall *self, void *closure)
{
    return PyUnicode_FromString("__call__");
}

static PyObject *
module_call_qualname(ModuleCall *self, void *closure)
{
    return PyUnicode_FromString("Module.__call__ (recording under fold.autobatch)");
}

static PyGetSetDef module_call_getset[] = {
    {"__name__", (getter)module_call_name, NULL, NULL, NULL},
    {"__qualname__", (getter)module_call_qualname, NULL, NULL, NULL},
    {NULL},
};

static PyMemberDef module_call_members[] = {
    {"inner", T_OBJECT, offsetof(ModuleCall, inner), READONLY, "the __call__ it wraps"},
    {NULL},
};

static PyTypeObject ModuleCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fold._clazy.ModuleCall",
    .tp_doc = PyDoc_STR("ModuleCall(inner, token, patches, eager_call): nn.Module.__call__ "
                        "while fold.autobatch records."),
    .tp_basicsize = sizeof(ModuleCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = module_call_new,
    .tp_dealloc = (destructor)module_call_dealloc,
    .tp_traverse = (traverseproc)module_call_traverse,
    .tp_clear = (inquiry)module_call_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(ModuleCall, vectorcall),
    .tp_descr_get = bind,
    .tp_getset = module_call_getset,
    .tp_members = module_call_members,
};

/* ------------------------------------------------------------------------- direct */

/* Direct(fn, dispatch, modes_on, enabled, dim_second): a torch function (torch.cat,
   torch.softmax, F.relu: patches._DIRECT_TORCH) while fold.autobatch is installed.  Where
   its first argument is a Lazy value, or a list or tuple holding one, and no torch-function
   mode is on (``modes_on()``) and torch functions are enabled (``enabled()``), the call goes
   to ``dispatch(fn, (Lazy,), args, kwargs)`` (Lazy.__torch_function__) at once, without
   torch's parse of every argument; ``f(x, dim=d)`` of a function whose second parameter is
   dim (``dim_second``) as ``f(x, d)``, the call the recorder's fast path takes.  Every
   other call goes to ``fn`` as it is.  What patches._direct_wrapper's Python does. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fn;
    PyObject *dispatch;
    PyObject *modes_on;
    PyObject *enabled;
    PyObject *dict;
    int dim_second;
} Direct;

static PyObject *s_dim;

static int
holds_lazy(PyObject *a)
{
    Py_ssize_t k = PySequence_Fast_GET_SIZE(a);
    PyObject **items = PySequence_Fast_ITEMS(a);
    for (Py_ssize_t j = 0; j < k; j++)
        if ((PyObject *)Py_TYPE(items[j]) == g_lazy_type)
            return 1;
    return 0;
}

/* 1 where calling ``f()`` gives True, 0 where False, -1 on an error. */
static int
truth_of_call(PyObject *f)
{
    PyObject *v = PyObject_CallNoArgs(f);
    if (v == NULL)
        return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

static PyObject *
direct_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Direct *self = (Direct *)op;
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (n < 1 || g_lazy_type == NULL)
        goto pass;
    PyObject *a = args[0];
    if (!((PyObject *)Py_TYPE(a) == g_lazy_type ||
          ((PyList_CheckExact(a) || PyTuple_CheckExact(a)) && holds_lazy(a))))
        goto pass;
    int modes = truth_of_call(self->modes_on);
    if (modes < 0)
        return NULL;
    if (modes)
        goto pass;
    int on = truth_of_call(self->enabled);
    if (on < 0)
        return NULL;
    if (!on)
        goto pass;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    PyObject *targs, *kw;
    if (self->dim_second && n == 1 && nkw == 1 &&
        PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, 0), s_dim) == 0) {
        targs = PyTuple_Pack(2, a, args[1]);
        kw = targs == NULL ? NULL : PyDict_New();
    }
    else {
        targs = PyTuple_New(n);
        if (targs != NULL)
            for (Py_ssize_t i = 0; i < n; i++) {
                Py_INCREF(args[i]);
                PyTuple_SET_ITEM(targs, i, args[i]);
            }
        kw = targs == NULL ? NULL : kwargs_of(args + n, kwnames);
    }
    PyObject *types = kw == NULL ? NULL : PyTuple_Pack(1, g_lazy_type);
    PyObject *out = NULL;
    if (types != NULL) {
        PyObject *call[4] = {self->fn, types, targs, kw};
        out = PyObject_Vectorcall(self->dispatch, call, 4, NULL);
    }
    Py_XDECREF(types);
    Py_XDECREF(kw);
    Py_XDECREF(targs);
    return out;
pass:
    return PyObject_Vectorcall(self->fn, args, nargsf, kwnames);
}

static PyObject *
direct_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *fn, *dispatch, *modes_on, *enabled;
    int dim_second;
    if (!PyArg_ParseTuple(args, "OOOOp", &fn, &dispatch, &modes_on, &enabled, &dim_second))
        return NULL;
    Direct *self = (Direct *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(fn);
    Py_INCREF(dispatch);
    Py_INCREF(modes_on);
    Py_INCREF(enabled);
    self->fn = fn;
    self->dispatch = dispatch;
    self->modes_on = modes_on;
    self->enabled = enabled;
    self->dict = NULL;
    self->dim_second = dim_second;
    self->vectorcall = direct_vectorcall;
    return (PyObject *)self;
}

static int
direct_traverse(Direct *self, visitproc visit, void *arg)
{
    Py_VISIT(self->fn);
    Py_VISIT(self->dispatch);
    Py_VISIT(self->modes_on);
    Py_VISIT(self->enabled);
    Py_VISIT(self->dict);
    return 0;
}

static int
direct_clear(Direct *self)
{
    Py_CLEAR(self->fn);
    Py_CLEAR(self->dispatch);
    Py_CLEAR(self->modes_on);
    Py_CLEAR(self->enabled);
    Py_CLEAR(self->dict);
    return 0;
}

static void
direct_dealloc(Direct *self)
{
    PyObject_GC_UnTrack(self);
    direct_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyGetSetDef direct_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyMemberDef direct_members[] = {
    {"fn", T_OBJECT, offsetof(Direct, fn), READONLY, "the torch function it stands for"},
    {NULL},
};

static PyTypeObject DirectType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fold._clazy.Direct",
    .tp_doc = PyDoc_STR("Direct(fn, dispatch, modes_on, enabled, dim_second): a torch "
                        "function while fold.autobatch is installed."),
    .tp_basicsize = sizeof(Direct),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = direct_new,
    .tp_dealloc = (destructor)direct_dealloc,
    .tp_traverse = (traverseproc)direct_traverse,
    .tp_clear = (inquiry)direct_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Direct, vectorcall),
    .tp_dictoffset = offsetof(Direct, dict),
    .tp_getset = direct_getset,
    .tp_members = direct_members,
};

/* ------------------------------------------------------------------------- tensorize */

/* Tensorize(fallback, plain, modes_on): torch.tensor while fold.autobatch is installed
   (patches._recording_tensor, ``fallback``).  ``torch.tensor(x)`` of one Python int, float
   or bool, no other argument, in the function autobatch runs (its recorder not paused, its
   examples not finishing as eager code) and no torch-function mode on, is the known value
   ``Known(x, meta, number)`` of ``plain[(type(x), torch.get_default_dtype())]`` (a tree's
   word ids at every leaf), made here without the Python wrapper's frame; every other call,
   and a key the table does not hold yet (the wrapper fills it), goes to ``fallback``. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback;
    PyObject *plain;
    PyObject *modes_on;
    PyObject *dict;
} Tensorize;

/* 1 where the recorder ``rec`` records an example's own calls now (not paused, its examples
   not finishing as eager code), 0 where not, -1 on an error. */
static int
records_now(PyObject *rec)
{
    PyObject *v = PyObject_GetAttr(rec, s_paused);
    int paused = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    if (paused != 0)
        return paused < 0 ? -1 : 0;
    PyObject *session = PyObject_GetAttr(rec, s_session);
    if (session == NULL)
        return -1;
    int eager = 0;
    if (session != Py_None) {
        v = PyObject_GetAttr(session, s_eager);
        eager = v == NULL ? -1 : PyObject_IsTrue(v);
        Py_XDECREF(v);
    }
    Py_DECREF(session);
    return eager < 0 ? -1 : !eager;
}

static PyObject *
tensorize_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Tensorize *self = (Tensorize *)op;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL || !configured())
        goto pass;
    PyObject *data = args[0];
    PyTypeObject *t = Py_TYPE(data);
    if (t != &PyLong_Type && t != &PyFloat_Type && t != &PyBool_Type)
        goto pass;
    PyObject *rec = PyObject_GetAttr(g_local, s_rec);
    if (rec == NULL)
        return NULL;
    int now = rec == Py_None ? 0 : records_now(rec);
    Py_DECREF(rec);
    if (now <= 0) {
        if (now < 0)
            return NULL;
        goto pass;
    }
    int modes = truth_of_call(self->modes_on);
    if (modes != 0) {
        if (modes < 0)
            return NULL;
        goto pass;
    }
    PyObject *dtype = PyObject_CallNoArgs(g_default_dtype);
    PyObject *key = dtype == NULL ? NULL : PyTuple_Pack(2, (PyObject *)t, dtype);
    Py_XDECREF(dtype);
    if (key == NULL)
        return NULL;
    PyObject *entry = PyDict_GetItemWithError(self->plain, key); /* borrowed */
    Py_DECREF(key);
    if (entry == NULL) {
        if (PyErr_Occurred())
            return NULL;
        goto pass;
    }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3)
        goto pass;
    Py_INCREF(entry); /* (held while used: the table may change under the calls below) */
    PyObject *meta = PyTuple_GET_ITEM(entry, 0), *number = PyTuple_GET_ITEM(entry, 1);
    PyObject *py = PyTuple_GET_ITEM(entry, 2);
    int num = PyObject_IsTrue(number);
    /* (the wrapper's py(x) where it travels as a number: x itself where py is its type) */
    PyObject *value = num < 0                           ? NULL
                      : num && py != (PyObject *)t ? PyObject_CallOneArg(py, data)
                                                   : Py_NewRef(data);
    PyObject *out = NULL;
    if (value != NULL) {
        PyObject *call[3] = {value, meta, number};
        out = PyObject_Vectorcall(g_known_type, call, 3, NULL);
        Py_DECREF(value);
    }
    Py_DECREF(entry);
    return out;
pass:
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

static PyObject *
tensorize_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *fallback, *plain, *modes_on;
    if (!PyArg_ParseTuple(args, "OO!O", &fallback, &PyDict_Type, &plain, &modes_on))
        return NULL;
    Tensorize *self = (Tensorize *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->fallback = Py_NewRef(fallback);
    self->plain = Py_NewRef(plain);
    self->modes_on = Py_NewRef(modes_on);
    self->dict = NULL;
    self->vectorcall = tensorize_vectorcall;
    return (PyObject *)self;
}

static int
tensorize_traverse(Tensorize *self, visitproc visit, void *arg)
{
    Py_VISIT(self->fallback);
    Py_VISIT(self->plain);
    Py_VISIT(self->modes_on);
    Py_VISIT(self->dict);
    return 0;
}

static int
tensorize_clear(Tensorize *self)
{
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->plain);
    Py_CLEAR(self->modes_on);
    Py_CLEAR(self->dict);
    return 0;
}

static void
tensorize_dealloc(Tensorize *self)
{
    PyObject_GC_UnTrack(self);
    tensorize_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef tensorize_members[] = {
    {"fallback", T_OBJECT, offsetof(Tensorize, fallback), READONLY, "the Python wrapper"},
    {NULL},
};

static PyTypeObject TensorizeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fold._clazy.Tensorize",
    .tp_doc = PyDoc_STR("Tensorize(fallback, plain, modes_on): torch.tensor while "
                        "fold.autobatch is installed."),
    .tp_basicsize = sizeof(Tensorize),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = tensorize_new,
    .tp_dealloc = (destructor)tensorize_dealloc,
    .tp_traverse = (traverseproc)tensorize_traverse,
    .tp_clear = (inquiry)tensorize_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Tensorize, vectorcall),
    .tp_dictoffset = offsetof(Tensorize, dict),
    .tp_getset = direct_getset,
    .tp_members = tensorize_members,
};

/* ------------------------------------------------------------------------- torch_function */

/* Whether a lazy value of ``rec`` (the recorder recording on this thread) is among ``args``
   (in lists and tuples too, one level). */
static int
records_among(PyObject *rec, PyObject *const *args, Py_ssize_t n)
{
    int found = 0;
    for (Py_ssize_t i = 0; i < n && !found; i++) {
        PyObject *a = args[i];
        if (PyList_CheckExact(a) || PyTuple_CheckExact(a)) {
            Py_ssize_t k = PySequence_Fast_GET_SIZE(a);
            PyObject **items = PySequence_Fast_ITEMS(a);
            for (Py_ssize_t j = 0; j < k && !found; j++)
                found = PyObject_TypeCheck(items[j], &LazyBaseType) &&
                        LAZY(items[j])->rec == rec;
        }
        else
            found = PyObject_TypeCheck(a, &LazyBaseType) && LAZY(a)->rec == rec;
    }
    return found;
}

/* torch_function(cls, func, types, args=(), kwargs=None): Lazy.__torch_function__. */
static PyObject *
torch_function(PyObject *module, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (!configured())
        return NULL;
    /* The call without keywords: as given, or as positional_call makes it. */
    PyObject *given[2 * MAX_FAST];
    PyObject *const *call = NULL;
    Py_ssize_t n = 0;
    if (kwnames == NULL && nargs >= 4 && nargs <= 5 && PyTuple_Check(args[3])) {
        if (nargs == 4 || args[4] == Py_None ||
            (PyDict_Check(args[4]) && PyDict_GET_SIZE(args[4]) == 0)) {
            call = &PyTuple_GET_ITEM(args[3], 0);
            n = PyTuple_GET_SIZE(args[3]);
        }
        else if (PyDict_CheckExact(args[4])) {
            n = positional_dict(args[1], &PyTuple_GET_ITEM(args[3], 0),
                                PyTuple_GET_SIZE(args[3]), args[4], given);
            if (n < 0)
                return NULL;
            if (n > 0)
                call = given;
        }
    }
    int flagged = call == NULL ? 0 : in_place_call(args[1], call, n);
    if (flagged < 0)
        return NULL;
    if (call != NULL && !flagged) {
        PyObject *rec = current_recorder();
        if (rec == NULL && PyErr_Occurred())
            return NULL;
        PyObject *out = NULL;
        /* Lazy values of earlier rounds alone: at once, before the fast key (which makes
           their literal rows) is built in vain. */
        if (rec != NULL && !records_among(rec, call, n)) {
            out = earlier_now(rec, args[1], call, n);
            if (out != g_miss) {
                Py_DECREF(rec);
                return out;
            }
            Py_DECREF(out);
        }
        out = rec == NULL ? miss() : fast_now(rec, args[1], g_torch_kind, call, n);
        Py_XDECREF(rec);
        if (out != g_miss)
            return out;
        Py_DECREF(out);
        out = eager_now(args[1], call, n);
        if (out != g_miss)
            return out;
        Py_DECREF(out);
    }
    return PyObject_Vectorcall(g_slow_function, args, nargs, kwnames);
}

/* ------------------------------------------------------------------------- module */

static PyObject *
configure(PyObject *module, PyObject *args)
{
    PyObject *v[16];
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOOOOO", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                          &v[6], &v[7], &v[8], &v[9], &v[10], &v[11], &v[12], &v[13], &v[14],
                          &v[15]))
        return NULL;
    if (!PyType_Check(v[0]) || !PyType_IsSubtype((PyTypeObject *)v[0], &LazyBaseType)) {
        PyErr_SetString(PyExc_TypeError, "configure: Lazy must subclass LazyBase");
        return NULL;
    }
    PyObject **slots[16] = {&g_lazy_type,    &g_module_type,   &g_tensor_type, &g_miss,
                            &g_local,        &g_grad_enabled,  &g_any_autocast, &g_torch_kind,
                            &g_slow_method,  &g_slow_function, &g_batched_kind, &g_long,
                            &g_bool,         &g_default_dtype, &g_known_type, &g_strided};
    for (int i = 0; i < 16; i++) {
        Py_INCREF(v[i]);
        Py_XSETREF(*slots[i], v[i]);
    }
    Py_RETURN_NONE;
}

/* configure_subscript(method): the Method that records x[key] on a lazy value (see
   lazy_subscript). */
static PyObject *
configure_subscript(PyObject *module, PyObject *method)
{
    Py_INCREF(method);
    Py_XSETREF(g_subscript, method);
    Py_RETURN_NONE;
}

/* views_in_use's work: the unique objects of the view log's entries from ``start`` on (the
   participants: lazy values and tensors, the views, the parts of a tuple of them, the
   arguments, the items of a list or tuple argument; and the containers: a tuple of views, a
   list or tuple argument), each with the references the log holds to it directly, and a
   union-find over the participants. */
typedef struct {
    PyObject **obj;
    Py_ssize_t *parent; /* (participants: their group; containers: unused) */
    Py_ssize_t *refs;   /* the log's references */
    Py_ssize_t n, cap;
} Objs;

static int
is_part(PyObject *o)
{
    return (PyObject *)Py_TYPE(o) == g_lazy_type ||
           PyObject_TypeCheck(o, (PyTypeObject *)g_tensor_type);
}

/* ``o``'s index in ``p``, added where new; -1 where out of memory. */
static Py_ssize_t
obj_index(Objs *p, PyObject *o)
{
    for (Py_ssize_t i = 0; i < p->n; i++)
        if (p->obj[i] == o)
            return i;
    if (p->n == p->cap) {
        Py_ssize_t cap = p->cap ? 2 * p->cap : 32;
        PyObject **obj = PyMem_Realloc(p->obj, cap * sizeof(PyObject *));
        if (obj == NULL)
            return -1;
        p->obj = obj;
        Py_ssize_t *parent = PyMem_Realloc(p->parent, cap * sizeof(Py_ssize_t));
        if (parent == NULL)
            return -1;
        p->parent = parent;
        Py_ssize_t *refs = PyMem_Realloc(p->refs, cap * sizeof(Py_ssize_t));
        if (refs == NULL)
            return -1;
        p->refs = refs;
        p->cap = cap;
    }
    p->obj[p->n] = o;
    p->parent[p->n] = p->n;
    p->refs[p->n] = 0;
    return p->n++;
}

static Py_ssize_t
obj_root(Objs *p, Py_ssize_t i)
{
    while (p->parent[i] != i)
        i = p->parent[i] = p->parent[p->parent[i]];
    return i;
}

/* views_in_use(log, start): the indices, in order, of the entries of the view log from
   ``start`` on whose views may share memory with a value in use: joined through their
   participants (a view and what it was taken of, views of views), the entries of a group
   with two participants or more held beyond the log (its entries' references, and those of
   the containers in it that nothing else holds) (buffers._views_in_use, the same in
   Python).  A view taken and let go, or one of a value nothing else holds, shares memory
   with nothing in use. */
static PyObject *
views_in_use(PyObject *module, PyObject *args)
{
    PyObject *log;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &log, &start))
        return NULL;
    if (!configured())
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(log);
    if (start < 0)
        start = 0;
    for (Py_ssize_t j = start; j < n; j++) {
        PyObject *e = PyList_GET_ITEM(log, j);
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 2 ||
            !PyTuple_CheckExact(PyTuple_GET_ITEM(e, 1))) {
            PyErr_SetString(PyExc_TypeError, "views_in_use: entries are (outputs, args tuple)");
            return NULL;
        }
    }
    Objs p = {NULL, NULL, NULL, 0, 0}, c = {NULL, NULL, NULL, 0, 0};
    Py_ssize_t *first = n > start ? PyMem_Malloc((n - start) * sizeof(Py_ssize_t)) : NULL;
    /* (container, item) pairs: the items a container holds, by index */
    Py_ssize_t *pairs = NULL, npairs = 0, cappairs = 0;
    Py_ssize_t *alive = NULL;
    PyObject *kept = NULL;
    if (n > start && first == NULL)
        goto nomem;
    for (Py_ssize_t j = start; j < n; j++) {
        PyObject *e = PyList_GET_ITEM(log, j), *eargs = PyTuple_GET_ITEM(e, 1);
        first[j - start] = -1;
        for (Py_ssize_t k = -1; k < PyTuple_GET_SIZE(eargs); k++) {
            PyObject *a = k < 0 ? PyTuple_GET_ITEM(e, 0) : PyTuple_GET_ITEM(eargs, k);
            int list = PyList_CheckExact(a), many = list || PyTuple_CheckExact(a);
            Py_ssize_t ci = -1;
            int again = 0; /* (a container met before: its items are paired once) */
            if (many) {
                Py_ssize_t known = c.n;
                if ((ci = obj_index(&c, a)) < 0)
                    goto nomem;
                again = ci < known;
                c.refs[ci] += 1;
            }
            else if (!is_part(a))
                continue;
            Py_ssize_t m = many ? (list ? PyList_GET_SIZE(a) : PyTuple_GET_SIZE(a)) : 1;
            for (Py_ssize_t i = 0; i < m; i++) {
                PyObject *o = !many ? a : list ? PyList_GET_ITEM(a, i) : PyTuple_GET_ITEM(a, i);
                if (!is_part(o))
                    continue;
                Py_ssize_t at = obj_index(&p, o);
                if (at < 0)
                    goto nomem;
                if (!many)
                    p.refs[at] += 1;
                else if (!again) {
                    if (npairs + 2 > cappairs) {
                        cappairs = cappairs ? 2 * cappairs : 64;
                        Py_ssize_t *more = PyMem_Realloc(pairs, cappairs * sizeof(Py_ssize_t));
                        if (more == NULL)
                            goto nomem;
                        pairs = more;
                    }
                    pairs[npairs++] = ci;
                    pairs[npairs++] = at;
                }
                if (first[j - start] < 0)
                    first[j - start] = at;
                else {
                    Py_ssize_t r1 = obj_root(&p, first[j - start]), r2 = obj_root(&p, at);
                    if (r1 != r2)
                        p.parent[r2] = r1;
                }
            }
        }
    }
    /* an item of a container nothing else holds: the log holds it through the container */
    for (Py_ssize_t q = 0; q < npairs; q += 2)
        if (Py_REFCNT(c.obj[pairs[q]]) <= c.refs[pairs[q]])
            p.refs[pairs[q + 1]] += 1;
    alive = p.n ? PyMem_Calloc(p.n, sizeof(Py_ssize_t)) : NULL;
    if (p.n && alive == NULL)
        goto nomem;
    for (Py_ssize_t i = 0; i < p.n; i++)
        if (Py_REFCNT(p.obj[i]) > p.refs[i])
            alive[obj_root(&p, i)] += 1;
    kept = PyList_New(0);
    for (Py_ssize_t j = start; kept != NULL && j < n; j++) {
        Py_ssize_t at = first[j - start];
        if (at < 0 || alive[obj_root(&p, at)] < 2)
            continue;
        PyObject *index = PyLong_FromSsize_t(j);
        if (index == NULL || PyList_Append(kept, index) < 0)
            Py_CLEAR(kept);
        Py_XDECREF(index);
    }
    goto done;
nomem:
    PyErr_NoMemory();
done:
    PyMem_Free(alive);
    PyMem_Free(pairs);
    PyMem_Free(first);
    PyMem_Free(p.obj);
    PyMem_Free(p.parent);
    PyMem_Free(p.refs);
    PyMem_Free(c.obj);
    PyMem_Free(c.parent);
    PyMem_Free(c.refs);
    return kept;
}

/* 1 where a call of ``func`` on ``args`` passes ``inplace=True`` (F.relu(h, True)), which the
   recorder records as a change of its first argument (values.in_place_form): the slow path
   takes it.  0 where not, -1 on error. */
static int
in_place_call(PyObject *func, PyObject *const *args, Py_ssize_t n)
{
    if (g_inplace_index == NULL)
        return 0;
    PyObject *index = PyDict_GetItemWithError(g_inplace_index, func); /* borrowed */
    if (index == NULL)
        return PyErr_Occurred() ? -1 : 0;
    Py_ssize_t i = PyLong_AsSsize_t(index);
    if (i == -1 && PyErr_Occurred())
        return -1;
    return i < n && args[i] == Py_True;
}

/* 1 where ``module`` is of a type that changes its input in place where built so
   (nn.ReLU(inplace=True): values._IN_PLACE_MODULES; the slow path looks), else 0. */
static int
in_place_module(PyObject *module)
{
    if (g_inplace_modules == NULL)
        return 0;
    int found = PySet_Contains(g_inplace_modules, (PyObject *)Py_TYPE(module));
    if (found < 0)
        PyErr_Clear();
    return found > 0;
}

/* configure_in_place(index, modules): values._INPLACE_INDEX and values._IN_PLACE_MODULES. */
static PyObject *
configure_in_place(PyObject *module, PyObject *args)
{
    PyObject *index, *modules;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &index, &modules))
        return NULL;
    if (!PyAnySet_Check(modules)) {
        PyErr_SetString(PyExc_TypeError, "configure_in_place: modules must be a set");
        return NULL;
    }
    Py_INCREF(index);
    Py_XSETREF(g_inplace_index, index);
    Py_INCREF(modules);
    Py_XSETREF(g_inplace_modules, modules);
    Py_RETURN_NONE;
}

/* configure_memo(pure, views, wrap, inference, note_shared, detach): values._PURE_METHODS,
   values._VIEW_METHODS, values._memo_wrap, torch.is_inference_mode_enabled,
   values._mark_shared (None: nothing noted) and torch.Tensor.detach. */
static PyObject *
configure_memo(PyObject *module, PyObject *args)
{
    PyObject *pure, *views, *wrap, *inference, *note, *detach;
    if (!PyArg_ParseTuple(args, "OOOOOO", &pure, &views, &wrap, &inference, &note, &detach))
        return NULL;
    if (!PyAnySet_Check(pure) || !PyAnySet_Check(views)) {
        PyErr_SetString(PyExc_TypeError, "configure_memo: pure and views must be sets");
        return NULL;
    }
    Py_INCREF(pure);
    Py_XSETREF(g_pure, pure);
    Py_INCREF(views);
    Py_XSETREF(g_memo_views, views);
    Py_INCREF(wrap);
    Py_XSETREF(g_memo_wrap, wrap);
    Py_INCREF(inference);
    Py_XSETREF(g_inference_enabled, inference);
    if (note == Py_None) /* (nothing noted: the C path checks no result) */
        Py_CLEAR(g_note_shared);
    else {
        Py_INCREF(note);
        Py_XSETREF(g_note_shared, note);
    }
    Py_INCREF(detach);
    Py_XSETREF(g_detach, detach);
    Py_RETURN_NONE;
}

static PyObject *
configure_defaults(PyObject *module, PyObject *args)
{
    PyObject *defaults, *positional, *fills;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyDict_Type, &defaults, &PyDict_Type, &positional,
                          &PyDict_Type, &fills))
        return NULL;
    Py_INCREF(defaults);
    Py_XSETREF(g_kw_defaults, defaults);
    Py_INCREF(positional);
    Py_XSETREF(g_positional, positional);
    Py_INCREF(fills);
    Py_XSETREF(g_fills, fills);
    Py_RETURN_NONE;
}

/* configure_written(cls): fold.autobatch.buffers._Written, the class of a written buffer,
   which the fast key refuses at once (see key_build). */
static PyObject *
configure_written(PyObject *module, PyObject *cls)
{
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "configure_written: a class");
        return NULL;
    }
    Py_INCREF(cls);
    Py_XSETREF(g_written, cls);
    Py_RETURN_NONE;
}

static PyObject *
configure_inline(PyObject *module, PyObject *inline_)
{
    if (!PyDict_CheckExact(inline_)) {
        PyErr_SetString(PyExc_TypeError, "configure_inline: a dict");
        return NULL;
    }
    Py_INCREF(inline_);
    Py_XSETREF(g_inline, inline_);
    Py_RETURN_NONE;
}

static PyMethodDef functions[] = {
    {"forget_noted", forget_noted, METH_NOARGS,
     PyDoc_STR("forget_noted(): a recorder begins; the objects noted are noted anew")},
    {"configure_written", configure_written, METH_O,
     PyDoc_STR("configure_written(buffers._Written): the class of a written buffer")},
    {"configure_inline", configure_inline, METH_O,
     PyDoc_STR("configure_inline(recorder._INLINE): the modules whose calls run through")},
    {"configure_defaults", configure_defaults, METH_VARARGS,
     PyDoc_STR("configure_defaults(values._KW_DEFAULTS, values._POSITIONAL, values._FILLS): "
               "keywords a call may drop or pass by position")},
    {"configure_subscript", configure_subscript, METH_O,
     PyDoc_STR("configure_subscript(method): the Method recording x[key]")},
    {"configure_in_place", configure_in_place, METH_VARARGS,
     PyDoc_STR("configure_in_place(inplace parameter index per function, module types)")},
    {"views_in_use", views_in_use, METH_VARARGS,
     PyDoc_STR("views_in_use(log, start): the view log's entries in use, last first")},
    {"configure_memo", configure_memo, METH_VARARGS,
     PyDoc_STR("configure_memo(pure methods, view methods, memo_wrap, "
               "torch.is_inference_mode_enabled, note_shared, Tensor.detach)")},
    {"configure", configure, METH_VARARGS,
     PyDoc_STR("configure(Lazy, Module, Tensor, MISS, LOCAL, is_grad_enabled, any_autocast, "
               "'torch', record_method, torch_function, BATCHED, torch.long, torch.bool, "
               "torch.get_default_dtype, Known)")},
    {"fast_key", (PyCFunction)(void (*)(void))fast_key, METH_FASTCALL,
     PyDoc_STR("fast_key(rec, fn, kind, args): the call's fast key, or None")},
    {"fast", (PyCFunction)(void (*)(void))fast, METH_FASTCALL,
     PyDoc_STR("fast(rec, fn, kind, args): the recorded outputs (from the table of the "
               "grad mode on now), or MISS")},
    {"torch_function", (PyCFunction)(void (*)(void))torch_function,
     METH_FASTCALL | METH_KEYWORDS,
     PyDoc_STR("Lazy.__torch_function__(cls, func, types, args, kwargs)")},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fold._clazy",
    .m_doc = PyDoc_STR("The hot path of autobatch's recording, in C (see fold.autobatch)."),
    .m_size = -1,
    .m_methods = functions,
};

static int
add_type(PyObject *m, const char *name, PyTypeObject *t)
{
    if (PyType_Ready(t) < 0)
        return -1;
    Py_INCREF(t);
    if (PyModule_AddObject(m, name, (PyObject *)t) < 0) {
        Py_DECREF(t);
        return -1;
    }
    return 0;
}

PyMODINIT_FUNC
PyInit__clazy(void)
{
    PyObject **strs[] = {&s_rec,      &s_paused,        &s_running, &s_fast,      &s_item,
                         &s_ndim,     &s_requires_grad, &s_dtype,   &s_device,    &s_call,
                         &s_number,   &s_meta,          &s_value,   &s_fast_nograd, &s_is_leaf,
                         &s_shape,    &s_unsqueeze,     &s_row,     &s_rows,
                         &s_values,   &s_session,       &s_narrow,  &s_rows_of,   &s_current};
    const char *names[] = {"rec",     "paused",        "running", "_fast",        "item",
                           "ndim",    "requires_grad", "dtype",   "device",       "_call",
                           "number",  "meta",          "value",   "_fast_nograd", "is_leaf",
                           "shape",   "unsqueeze",     "row",     "_rows",
                           "values",  "session",       "narrow",  "rows_of",      "current"};
    for (int i = 0; i < 24; i++)
        if ((*strs[i] = PyUnicode_InternFromString(names[i])) == NULL)
            return NULL;
    PyObject **more[] = {&s_token,    &s_eager,   &s_record,  &s_module_kind, &s_literals,
                         &s_aliases,  &s_version, &s_example, &s_base,        &s_row_literal,
                         &s_row_of,   &s_memo,    &s_rounds,  &s_row_views,   &s_is_inference, &s_clone};
    const char *more_names[] = {"token",    "eager",   "record",   "module", "literals",
                                "aliases",  "_version", "example", "_base",  "row_literal",
                                "row_of",   "memo",    "rounds",   "_row_views", "is_inference", "clone"};
    for (int i = 0; i < 16; i++)
        if ((*more[i] = PyUnicode_InternFromString(more_names[i])) == NULL)
            return NULL;
    if ((s_layout = PyUnicode_InternFromString("layout")) == NULL)
        return NULL;
    if ((s_dim = PyUnicode_InternFromString("dim")) == NULL ||
        (s_state = PyUnicode_InternFromString("state")) == NULL ||
        (s_note_state = PyUnicode_InternFromString("note_state")) == NULL)
        return NULL;
    for (int i = 0; i < 64; i++)
        if ((g_small[i] = PyLong_FromLong(i)) == NULL)
            return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "MAX_FAST", MAX_FAST) < 0 ||
        add_type(m, "LazyBase", &LazyBaseType) < 0 ||
        add_type(m, "BatchableBase", &BatchableBaseType) < 0 ||
        add_type(m, "Method", &MethodType) < 0 ||
        add_type(m, "ModuleCall", &ModuleCallType) < 0 ||
        add_type(m, "Direct", &DirectType) < 0 ||
        add_type(m, "Tensorize", &TensorizeType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
