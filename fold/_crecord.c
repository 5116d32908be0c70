/* fold._crecord: the fast path of a generated recorder, in C.

   fold.graph generates, per argument pattern, a Python recorder (see _recorder_source).  A
   Recorder here runs the first branch of that function for patterns whose arguments are
   nodes, Python ints/floats/bools, lists of nodes and literal tensors: it checks the
   argument types, builds the same memo key the Python recorder builds (packed int64 bytes
   where every argument is a node; otherwise a tuple of plain ints, the numbers themselves,
   the bytes of each list's int64 handles and each tensor's id), looks the node up in the
   same memo dict, records it if new (depth one step after the deepest node argument, id
   from the Fold's shared counter) and returns the handle, whole or split.

   With literal tensors the memo is the one of the tensors' shapes and dtypes: ``sigs`` maps
   (shape, dtype, ...) of the tensors, in argument order, to (memo, targs), and a new node's
   arguments go to targs as the Python recorder appends them (the key, each tensor in place
   of its id).  Shapes not in ``sigs`` yet (a new signature, or a tensor that is no batch of
   one) are the Python recorder's.

   Everything else (another type or arity, keywords, a list holding anything but this Fold's
   nodes, a float zero, a handle or depth beyond int64) is handed to the Python recorder
   before anything is written, so it alone raises FoldErrors and handles rare values, and
   both paths always agree.  Handle layout and memo keys: fold/_encoding.py (DEPTH_SHIFT,
   ID_SHIFT, KEY_SOURCE, LIST_INLINE, packed); a change there is a change here too, and
   tests/test_crecord.py compares the two recorders on random calls. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define K_NODE 0
#define K_INT 1
#define K_FLOAT 2
#define K_BOOL 3
#define K_LIST 4
#define K_TENSOR 5
#define MAX_ARGS 64
#define DEPTH_SHIFT 44
#define ID_SHIFT 16

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback; /* the Python recorder of the same pattern and state */
    PyObject *types;    /* tuple: the exact type of each argument */
    PyObject *node_type;
    PyObject *memo;     /* dict: key -> handle (a plain int); unused with tensors */
    PyObject *sigs;     /* with literal tensors, dict: shapes and dtypes -> (memo, targs) */
    PyObject *ids;      /* iterator of node ids, shared by the Fold's recorders */
    PyObject *name;
    PyObject *weakrefs;
    int64_t code;       /* split code of output 0; 0 for a whole node */
    Py_ssize_t nargs;
    int outputs;        /* 0: a whole node; n: a tuple of n outputs */
    int packed;         /* all arguments nodes: one bytes key */
    int tensors;        /* how many literal tensor arguments */
    unsigned char kinds[MAX_ARGS];
} Recorder;

static PyObject *str_shape, *str_dtype;

static PyObject *
fall_back(Recorder *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

/* A node's handle as int64; 0 with *ok = 0 where it does not fit. */
static inline int64_t
handle_of(PyObject *a, int *ok)
{
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        *ok = 0;
        return 0;
    }
    return (int64_t)v;
}

/* n handles as int64 into buf, the deepest folded into *deepest; 0 where one is not of
   node_type (when given) or does not fit in int64.  A packed key's arguments (their types
   checked by the caller) and a list's elements alike. */
static int
handles_into(PyObject *const *items, Py_ssize_t n, PyObject *node_type, char *buf,
             int64_t *deepest)
{
    for (Py_ssize_t j = 0; j < n; j++) {
        int ok = 1;
        if (node_type != NULL && (PyObject *)Py_TYPE(items[j]) != node_type)
            return 0;
        int64_t v = handle_of(items[j], &ok);
        if (!ok || v < 0) /* a negative handle is forged: the Python recorder's */
            return 0;
        memcpy(buf + 8 * j, &v, 8);
        if (v > *deepest)
            *deepest = v;
    }
    return 1;
}

/* The bytes of a list's int64 handles, its deepest handle folded into *deepest; NULL with no
   error set where the list holds anything but this Fold's nodes or a handle beyond int64. */
static PyObject *
list_key(PyObject *list, PyObject *node_type, int64_t *deepest)
{
    Py_ssize_t n = PyList_GET_SIZE(list);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out == NULL)
        return NULL;
    if (!handles_into(((PyListObject *)list)->ob_item, n, node_type, PyBytes_AS_STRING(out),
                      deepest)) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* A handle object of the Fold's Node class. */
static inline PyObject *
make_node(PyObject *node_type, int64_t h)
{
    PyObject *v = PyLong_FromLongLong(h);
    if (v == NULL)
        return NULL;
    PyObject *node = PyObject_CallOneArg(node_type, v);
    Py_DECREF(v);
    return node;
}

/* A new node's arguments as the Python recorder appends them to targs: its key, each
   tensor in place of its id. */
static int
append_row(Recorder *self, PyObject *const *args, PyObject *key, PyObject *targs)
{
    Py_ssize_t n = PyTuple_GET_SIZE(key);
    PyObject *row = PyTuple_New(n);
    if (row == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = self->kinds[i] == K_TENSOR ? args[i] : PyTuple_GET_ITEM(key, i);
        Py_INCREF(v);
        PyTuple_SET_ITEM(row, i, v);
    }
    int bad = PyList_Append(targs, row);
    Py_DECREF(row);
    return bad;
}

/* The memo key of a call whose types were checked, looked up in memo (and the node recorded
   there, its arguments appended to targs where targs is not NULL): the handle, whole or
   split. */
static PyObject *
record_in(Recorder *self, PyObject *const *args, size_t nargsf, PyObject *kwnames,
          PyObject *memo, PyObject *targs)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    int64_t deepest = -1; /* as the Python recorder's max(), -1 standing for "no node" */
    PyObject *key;
    if (self->packed) {
        key = PyBytes_FromStringAndSize(NULL, n * 8);
        if (key == NULL)
            return NULL;
        if (!handles_into(args, n, NULL, PyBytes_AS_STRING(key), &deepest)) {
            Py_DECREF(key);
            return fall_back(self, args, nargsf, kwnames);
        }
    }
    else {
        key = PyTuple_New(n);
        if (key == NULL)
            return NULL;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *a = args[i], *part = NULL;
            int ok = 1;
            switch (self->kinds[i]) {
            case K_NODE: {
                int64_t v = handle_of(a, &ok);
                if (ok && v < 0) /* forged (see handles_into) */
                    ok = 0;
                if (ok) {
                    part = PyLong_FromLongLong(v);
                    if (part == NULL) {
                        Py_DECREF(key);
                        return NULL;
                    }
                    if (v > deepest)
                        deepest = v;
                }
                break;
            }
            case K_FLOAT:
                /* -0.0 and 0.0 are keyed apart by the Python recorder's float_key. */
                if (PyFloat_AS_DOUBLE(a) != 0.0) {
                    Py_INCREF(a);
                    part = a;
                }
                else
                    ok = 0;
                break;
            case K_LIST:
                part = list_key(a, self->node_type, &deepest);
                if (part == NULL) {
                    if (PyErr_Occurred()) {
                        Py_DECREF(key);
                        return NULL;
                    }
                    ok = 0;
                }
                break;
            case K_TENSOR: /* keyed by identity, as id() */
                part = PyLong_FromVoidPtr(a);
                if (part == NULL) {
                    Py_DECREF(key);
                    return NULL;
                }
                break;
            default: /* int, bool: the number itself */
                Py_INCREF(a);
                part = a;
            }
            if (!ok) {
                Py_DECREF(key);
                return fall_back(self, args, nargsf, kwnames);
            }
            PyTuple_SET_ITEM(key, i, part);
        }
        /* Its items are ints, floats and bytes, which hold no references: the memo keeps
           the key for the graph's life, and a tracked key would be traversed by the first
           collection after recording (the collector untracks such tuples only then). */
        PyObject_GC_UnTrack(key);
    }
    /* One step after the deepest node; a depth that would leave int64 is the Python
       recorder's (unbounded ints). */
    if ((deepest >> DEPTH_SHIFT) >= ((int64_t)1 << (63 - DEPTH_SHIFT)) - 1) {
        Py_DECREF(key);
        return fall_back(self, args, nargsf, kwnames);
    }
    PyObject *found = PyDict_GetItemWithError(memo, key);
    int64_t h;
    if (found != NULL) {
        int ok = 1;
        h = handle_of(found, &ok);
        if (!ok) {
            Py_DECREF(key);
            return fall_back(self, args, nargsf, kwnames);
        }
        Py_DECREF(key);
    }
    else {
        if (PyErr_Occurred()) {
            Py_DECREF(key);
            return NULL;
        }
        PyObject *id_obj = PyIter_Next(self->ids);
        if (id_obj == NULL) {
            Py_DECREF(key);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "fold: the node id counter ended");
            return NULL;
        }
        int ok = 1;
        int64_t id = handle_of(id_obj, &ok);
        if (!ok || id < 0 || id >= ((int64_t)1 << (63 - ID_SHIFT))) {
            /* Beyond int64: as the Python recorder computes it, with Python ints. */
            PyObject *depth = PyLong_FromLongLong(((deepest >> DEPTH_SHIFT) + 1) << DEPTH_SHIFT);
            PyObject *shift = PyLong_FromLong(ID_SHIFT);
            PyObject *hi = (depth && shift) ? PyNumber_Lshift(id_obj, shift) : NULL;
            PyObject *hv = hi ? PyNumber_Or(depth, hi) : NULL;
            Py_XDECREF(depth);
            Py_XDECREF(shift);
            Py_XDECREF(hi);
            Py_DECREF(id_obj);
            if (hv == NULL || PyDict_SetItem(memo, key, hv) < 0 ||
                (targs != NULL && append_row(self, args, key, targs) < 0)) {
                Py_XDECREF(hv);
                Py_DECREF(key);
                return NULL;
            }
            Py_DECREF(key);
            Py_DECREF(hv);
            /* Recorded: the Python recorder now finds it in the memo. */
            return fall_back(self, args, nargsf, kwnames);
        }
        Py_DECREF(id_obj);
        h = ((((deepest >> DEPTH_SHIFT) + 1) << DEPTH_SHIFT)) | (id << ID_SHIFT);
        PyObject *hv = PyLong_FromLongLong(h);
        if (hv == NULL || PyDict_SetItem(memo, key, hv) < 0) {
            Py_XDECREF(hv);
            Py_DECREF(key);
            return NULL;
        }
        Py_DECREF(hv);
        if (targs != NULL && append_row(self, args, key, targs) < 0) {
            Py_DECREF(key);
            return NULL;
        }
        Py_DECREF(key);
    }
    if (self->outputs == 0)
        return make_node(self->node_type, h);
    PyObject *out = PyTuple_New(self->outputs);
    if (out == NULL)
        return NULL;
    int64_t b = h | self->code;
    for (int j = 0; j < self->outputs; j++) {
        PyObject *node = make_node(self->node_type, b | j);
        if (node == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, j, node);
    }
    return out;
}

static PyObject *
recorder_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Recorder *self = (Recorder *)op;
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (self->fallback == NULL || self->types == NULL || self->node_type == NULL ||
        self->memo == NULL || self->ids == NULL || (self->tensors && self->sigs == NULL)) {
        /* tp_clear ran (the collector, or gc.get_objects() and a caller of tp_clear). */
        PyErr_SetString(PyExc_ReferenceError, "fold: this recorder was cleared; its Fold is "
                                              "gone. Fix: record with a live Fold's add/op.");
        return NULL;
    }
    if (kwnames != NULL || n != self->nargs)
        return fall_back(self, args, nargsf, kwnames);
    for (Py_ssize_t i = 0; i < n; i++)
        if ((PyObject *)Py_TYPE(args[i]) != PyTuple_GET_ITEM(self->types, i))
            return fall_back(self, args, nargsf, kwnames);
    if (!self->tensors)
        return record_in(self, args, nargsf, kwnames, self->memo, NULL);

    /* The tensors' shapes and dtypes, flat in argument order: the key of sigs. */
    PyObject *shapes = PyTuple_New(2 * self->tensors);
    if (shapes == NULL)
        return NULL;
    Py_ssize_t t = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (self->kinds[i] != K_TENSOR)
            continue;
        PyObject *shape = PyObject_GetAttr(args[i], str_shape);
        PyObject *dtype = shape ? PyObject_GetAttr(args[i], str_dtype) : NULL;
        if (dtype == NULL) {
            Py_XDECREF(shape);
            Py_DECREF(shapes);
            return NULL;
        }
        PyTuple_SET_ITEM(shapes, t++, shape);
        PyTuple_SET_ITEM(shapes, t++, dtype);
    }
    PyObject *entry = PyDict_GetItemWithError(self->sigs, shapes); /* borrowed */
    Py_DECREF(shapes);
    if (entry == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return fall_back(self, args, nargsf, kwnames); /* a new signature: Python's */
    }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2 ||
        !PyDict_CheckExact(PyTuple_GET_ITEM(entry, 0)) ||
        !PyList_CheckExact(PyTuple_GET_ITEM(entry, 1)))
        return fall_back(self, args, nargsf, kwnames);
    /* Owned while the key is built and looked up: nothing in sigs may go meanwhile. */
    Py_INCREF(entry);
    PyObject *out = record_in(self, args, nargsf, kwnames, PyTuple_GET_ITEM(entry, 0),
                              PyTuple_GET_ITEM(entry, 1));
    Py_DECREF(entry);
    return out;
}

static PyObject *
recorder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"fallback", "kinds", "types", "node_type", "memo", "ids",
                            "outputs", "code", "name", "sigs", NULL};
    PyObject *fallback, *kinds, *types, *node_type, *memo, *ids, *outputs, *name;
    PyObject *sigs = NULL;
    long long code;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!O!OO!OOLU|O!", names, &fallback,
                                     &PyTuple_Type, &kinds, &PyTuple_Type, &types, &node_type,
                                     &PyDict_Type, &memo, &ids, &outputs, &code, &name,
                                     &PyDict_Type, &sigs))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(kinds);
    if (n < 1 || n > MAX_ARGS || PyTuple_GET_SIZE(types) != n) {
        PyErr_SetString(PyExc_ValueError, "Recorder: 1 to 64 kinds, one type per kind");
        return NULL;
    }
    if (!PyType_Check(node_type) || !PyIter_Check(ids)) {
        PyErr_SetString(PyExc_TypeError, "Recorder: node_type a type, ids an iterator");
        return NULL;
    }
    int out_n = 0;
    if (outputs != Py_None) {
        long o = PyLong_AsLong(outputs);
        if (o == -1 && PyErr_Occurred())
            return NULL;
        if (o < 1 || o > 128) {
            PyErr_SetString(PyExc_ValueError, "Recorder: outputs None or 1 to 128");
            return NULL;
        }
        out_n = (int)o;
    }
    Recorder *self = PyObject_GC_New(Recorder, type);
    if (self == NULL)
        return NULL;
    self->fallback = self->types = self->node_type = self->memo = self->ids = NULL;
    self->name = self->weakrefs = self->sigs = NULL;
    int packed = 1, tensors = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long k = PyLong_AsLong(PyTuple_GET_ITEM(kinds, i));
        if (k < K_NODE || k > K_TENSOR) {
            Py_DECREF(self);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "Recorder: a kind of node, int, float, "
                                                  "bool, list or tensor");
            return NULL;
        }
        /* Each kind's argument type: what recorder_call compares exactly, and what its
           branch reads the argument as (a node as an int, a float's double, a list's items). */
        PyObject *t = PyTuple_GET_ITEM(types, i);
        int fits = k == K_NODE    ? t == node_type && PyType_IsSubtype((PyTypeObject *)t,
                                                                         &PyLong_Type)
                   : k == K_INT   ? t == (PyObject *)&PyLong_Type
                   : k == K_FLOAT ? t == (PyObject *)&PyFloat_Type
                   : k == K_BOOL  ? t == (PyObject *)&PyBool_Type
                   : k == K_LIST  ? t == (PyObject *)&PyList_Type
                                  : PyType_Check(t); /* a tensor: any type, compared exactly */
        if (!fits) {
            Py_DECREF(self);
            PyErr_Format(PyExc_TypeError, "Recorder: argument %zd's type does not fit its kind "
                                          "(node_type, int, float, bool or list)", i);
            return NULL;
        }
        self->kinds[i] = (unsigned char)k;
        packed &= k == K_NODE;
        tensors += k == K_TENSOR;
    }
    if (tensors && sigs == NULL) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_TypeError, "Recorder: literal tensors need sigs, the dict of "
                                         "their shapes and dtypes -> (memo, targs)");
        return NULL;
    }
    self->vectorcall = recorder_call;
    Py_INCREF(fallback);
    self->fallback = fallback;
    Py_INCREF(types);
    self->types = types;
    Py_INCREF(node_type);
    self->node_type = node_type;
    Py_INCREF(memo);
    self->memo = memo;
    Py_INCREF(ids);
    self->ids = ids;
    Py_INCREF(name);
    self->name = name;
    self->code = (int64_t)code;
    self->nargs = n;
    self->outputs = out_n;
    self->packed = packed;
    self->tensors = tensors;
    Py_XINCREF(sigs);
    self->sigs = sigs;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static int
recorder_traverse(Recorder *self, visitproc visit, void *arg)
{
    Py_VISIT(self->fallback);
    Py_VISIT(self->types);
    Py_VISIT(self->node_type);
    Py_VISIT(self->memo);
    Py_VISIT(self->ids);
    Py_VISIT(self->sigs);
    return 0;
}

static int
recorder_clear(Recorder *self)
{
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->types);
    Py_CLEAR(self->node_type);
    Py_CLEAR(self->memo);
    Py_CLEAR(self->ids);
    Py_CLEAR(self->sigs);
    Py_CLEAR(self->name);
    return 0;
}

static void
recorder_dealloc(Recorder *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    recorder_clear(self);
    PyObject_GC_Del(self);
}

static PyObject *
recorder_repr(Recorder *self)
{
    if (self->name == NULL)
        return PyUnicode_FromString("<cleared fold recorder>");
    return PyUnicode_FromFormat("<fold recorder %U>", self->name);
}

static PyObject *
recorder_get_name(Recorder *self, void *closure)
{
    if (self->name == NULL)
        return PyUnicode_FromString("<cleared fold recorder>");
    Py_INCREF(self->name);
    return self->name;
}

static int
recorder_set_name(Recorder *self, PyObject *value, void *closure)
{
    if (value == NULL || !PyUnicode_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "__name__ must be a str");
        return -1;
    }
    Py_INCREF(value);
    Py_SETREF(self->name, value);
    return 0;
}

static PyObject *
recorder_get_fallback(Recorder *self, void *closure)
{
    if (self->fallback == NULL)
        Py_RETURN_NONE; /* cleared */
    Py_INCREF(self->fallback);
    return self->fallback;
}

/* _clear(): what the collector's tp_clear does, for tests of a cleared recorder (one that
   Python code reached through gc.get_objects() while a collection cleared it). */
static PyObject *
recorder_clear_method(Recorder *self, PyObject *unused)
{
    recorder_clear(self);
    Py_RETURN_NONE;
}

/* rebind(ids): take node ids from another counter (fold.graph.Fold._renew: the same Fold,
   its graph emptied for the next one, as autobatch's rounds record, numbers its nodes from 0
   again). */
static PyObject *
recorder_rebind(Recorder *self, PyObject *ids)
{
    if (!PyIter_Check(ids)) {
        PyErr_SetString(PyExc_TypeError, "Recorder.rebind: ids must be an iterator");
        return NULL;
    }
    Py_INCREF(ids);
    Py_XSETREF(self->ids, ids);
    Py_RETURN_NONE;
}

static PyMethodDef recorder_methods[] = {
    {"rebind", (PyCFunction)recorder_rebind, METH_O,
     "rebind(ids): take node ids from another counter"},
    {"_clear", (PyCFunction)recorder_clear_method, METH_NOARGS,
     "clear the fields as the garbage collector's tp_clear does (tests only)"},
    {NULL},
};

static PyGetSetDef recorder_getset[] = {
    {"__name__", (getter)recorder_get_name, (setter)recorder_set_name, NULL, NULL},
    {"__qualname__", (getter)recorder_get_name, (setter)recorder_set_name, NULL, NULL},
    {"fallback", (getter)recorder_get_fallback, NULL,
     "the Python recorder that takes every call this one does not", NULL},
    {NULL},
};

static PyTypeObject RecorderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fold._crecord.Recorder",
    .tp_doc = PyDoc_STR("Recorder(fallback, kinds, types, node_type, memo, ids, outputs, "
                        "code, name, sigs=None): a generated recorder's fast path (see "
                        "fold.graph)."),
    .tp_basicsize = sizeof(Recorder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = recorder_new,
    .tp_dealloc = (destructor)recorder_dealloc,
    .tp_traverse = (traverseproc)recorder_traverse,
    .tp_clear = (inquiry)recorder_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Recorder, vectorcall),
    .tp_weaklistoffset = offsetof(Recorder, weakrefs),
    .tp_repr = (reprfunc)recorder_repr,
    .tp_getset = recorder_getset,
    .tp_methods = recorder_methods,
};

/* ------------------------------------------------------------------------- Counter */

/* Counter(): node ids 0, 1, 2, ... as itertools.count() gives them (its repr too), how
   many it gave as `issued` (which fold.graph.Fold._check_intact reads), and reset(), which
   starts them from 0 again: a renewed Fold (autobatch's rounds) resets its one counter,
   where every recorder of the Fold would otherwise be rebound to a new one. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t next;
} Counter;

static PyObject *
counter_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Counter() takes no arguments");
        return NULL;
    }
    Counter *self = (Counter *)type->tp_alloc(type, 0);
    if (self != NULL)
        self->next = 0;
    return (PyObject *)self;
}

static PyObject *
counter_iternext(Counter *self)
{
    return PyLong_FromSsize_t(self->next++);
}

static PyObject *
counter_reset(Counter *self, PyObject *unused)
{
    self->next = 0;
    Py_RETURN_NONE;
}

static PyObject *
counter_repr(Counter *self)
{
    return PyUnicode_FromFormat("count(%zd)", self->next);
}

static PyObject *
counter_issued(Counter *self, void *unused)
{
    return PyLong_FromSsize_t(self->next);
}

static PyGetSetDef counter_getset[] = {
    {"issued", (getter)counter_issued, NULL, "how many ids it gave: the next one", NULL},
    {NULL},
};

static PyMethodDef counter_methods[] = {
    {"reset", (PyCFunction)counter_reset, METH_NOARGS, "reset(): the next id is 0 again"},
    {NULL},
};

static PyTypeObject CounterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fold._crecord.Counter",
    .tp_doc = PyDoc_STR("Counter(): node ids from 0, as itertools.count(), with reset()."),
    .tp_basicsize = sizeof(Counter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = counter_new,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)counter_iternext,
    .tp_repr = (reprfunc)counter_repr,
    .tp_methods = counter_methods,
    .tp_getset = counter_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fold._crecord",
    .m_doc = PyDoc_STR("The fast path of fold's generated recorders, in C."),
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__crecord(void)
{
    if (PyType_Ready(&RecorderType) < 0 || PyType_Ready(&CounterType) < 0)
        return NULL;
    str_shape = PyUnicode_InternFromString("shape");
    str_dtype = PyUnicode_InternFromString("dtype");
    if (str_shape == NULL || str_dtype == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RecorderType);
    if (PyModule_AddObject(m, "Recorder", (PyObject *)&RecorderType) < 0) {
        Py_DECREF(&RecorderType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&CounterType);
    if (PyModule_AddObject(m, "Counter", (PyObject *)&CounterType) < 0) {
        Py_DECREF(&CounterType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
