"""The receipt check of the data-science agents' pickles: this file's source runs INSIDE the sandbox, in the
episode's workspace (`mappa.tasks.dsbench.receipts.receipt_code` sends it). The trainer never runs it: agent files
are never unpickled on the host.

`check(expect)` loads each file named in `expect` and prints one line, MARKER + JSON: per file whether it holds
what it claims (`ok`), what it is (`kind`, a type name), its rows and columns, and why not (`why`).

A pickle is a program: plain `pickle.load` runs whatever callable the file names, and such code could print a
forged report. So the files load through `SafeLoader`, the pure-Python unpickler with every opcode that calls,
builds or mutates checked:
- a global is fetched only from numpy, pandas, scipy, scikit-learn or pyarrow (the class or function itself
  defined there, not a re-export), or is one of a few builtins (`SAFE_GLOBALS`); never a module; no dotted
  name reaching a private attribute;
- a call (REDUCE, NEWOBJ, INST, OBJ) goes only to a fetched class or to a library's own rebuild function
  (`REBUILDERS`: what numpy, pandas, pyarrow and scikit-learn pickle with), never to an object the pickle built;
- BUILD uses the class's `__setstate__` (never one planted on the instance), never touches a fetched global, and
  refuses state that plants a dunder attribute; appends and item sets go through the class, never to a global.
A pickle that needs anything else is refused with the name it asked for: no code of the agent's runs here, so a
file's receipt says what the file loads as. What it does not rule out: a chain of the allowed libraries' own
constructors crafted to misbehave (none is known), and content that is real but poor (quality is the
submission's test, not the receipt's).

No `from __future__` import here: `receipt_code` puts lines before this source (the import path, cleaned first).
"""

import _compat_pickle
import json
import os
import pickle
import stat
import sys
import types

MARKER = "mappa-receipts:"
PACKAGES = ("numpy", "pandas", "scipy", "sklearn", "pyarrow")
SAFE_GLOBALS = frozenset(
    {("builtins", n) for n in ("bytearray", "bytes", "bool", "complex", "dict", "float", "frozenset", "int")}
    | {("builtins", n) for n in ("list", "object", "range", "set", "slice", "str", "tuple", "getattr")}
    | {("datetime", n) for n in ("date", "datetime", "time", "timedelta", "timezone")}
    | {("copyreg", "_reconstructor"), ("_codecs", "encode"), ("functools", "partial"), ("zoneinfo", "ZoneInfo")}
    | {("collections", "OrderedDict"), ("collections", "defaultdict"), ("decimal", "Decimal")}
)
SAFE_CALLS = frozenset({("copyreg", "_reconstructor"), ("_codecs", "encode")})
# The libraries' own rebuild functions (numpy arrays and scalars, pandas blocks and indexes, pyarrow arrays,
# scikit-learn's Cython trees), and every Cython class's generated `__pyx_unpickle_<Class>`.
REBUILDERS = frozenset(
    {"_reconstruct", "scalar", "_frombuffer", "_mareconstruct", "_ufunc_reconstruct"}
    | {"__randomstate_ctor", "__bit_generator_ctor", "__generator_ctor", "newObj"}
    | {"_unpickle_block", "new_block", "_new_Index", "_new_DatetimeIndex", "_new_PeriodIndex", "_new_IntervalIndex"}
    | {"_unpickle_timestamp", "_timedelta_unpickle", "__nat_unpickle", "_restore_array", "py_buffer", "type_for_alias"}
)
CLASS_REBUILDERS = frozenset({"_unpickle"})  # getattr(zoneinfo.ZoneInfo, "_unpickle"): time zones
LIBRARIES = "numpy, pandas, scipy, scikit-learn and pyarrow objects"


class Refused(pickle.UnpicklingError):
    """The pickle asks for something outside what a plain data or model file needs."""


def _home(obj):
    """The module an object was defined in; None when it has none (then it is refused)."""
    return obj.__module__ if isinstance(obj, type) else getattr(obj, "__module__", None)


def _dunders(obj):
    names = getattr(obj, "__dict__", None)
    return [k for k in names if isinstance(k, str) and k.startswith("__")] if isinstance(names, dict) else []


class SafeLoader(pickle._Unpickler):
    """`pickle._Unpickler` with every opcode that fetches, calls, builds or mutates checked (module docstring)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file):
        super().__init__(file)
        self.fetched = {}  # id -> object: the globals this pickle fetched (kept alive, so ids stay unique)
        self.callable_ids = set()  # ids of the fetched functions it may call

    def find_class(self, module, name):
        if self.proto < 3 and self.fix_imports:
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        safe = (module, name) in SAFE_GLOBALS
        parts = name.split(".")
        if not safe and (module.split(".")[0] not in PACKAGES or any(p.startswith("_") for p in parts[1:])):
            raise Refused(f"refused {module}.{name}: only {LIBRARIES}")
        __import__(module, level=0)
        obj = sys.modules[module]
        for part in parts:
            obj = getattr(obj, part)
        home = _home(obj) if (isinstance(obj, type) or callable(obj)) else _home(type(obj))
        if isinstance(obj, types.ModuleType) or not isinstance(home, str):
            raise Refused(f"refused {module}.{name}: not a class, a function or a constant")
        if not safe and home.split(".")[0] not in PACKAGES:
            raise Refused(f"refused {module}.{name}: defined in {home}, only {LIBRARIES}")
        self.fetched[id(obj)] = obj
        rebuilder = name in REBUILDERS or name.startswith("__pyx_unpickle_") or (module, name) in SAFE_CALLS
        if callable(obj) and not isinstance(obj, type) and rebuilder:
            self.callable_ids.add(id(obj))
        return obj

    def _check_call(self, func, args):
        if isinstance(func, type) and id(func) in self.fetched:
            return
        if id(func) in self.callable_ids:
            return
        getattr_call = self.fetched.get(id(func)) is getattr and len(args) == 2
        if getattr_call and isinstance(args[0], type) and id(args[0]) in self.fetched and args[1] in CLASS_REBUILDERS:
            return
        raise Refused(f"refused a call to {getattr(func, '__qualname__', type(func).__name__)}")

    def _call(self, func, args):
        self._check_call(func, args)
        value = func(*args)
        if func is getattr:  # the class's own rebuild method: callable like a fetched rebuild function
            self.fetched[id(value)] = value
            self.callable_ids.add(id(value))
        return value

    def load_reduce(self):
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args)

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        self._new(cls)
        self.append(cls.__new__(cls, *args))

    def load_newobj_ex(self):
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self._new(cls)
        self.append(cls.__new__(cls, *args, **kwargs))

    def _new(self, cls):
        if not (isinstance(cls, type) and id(cls) in self.fetched):
            raise Refused("refused to create an object of a class it did not name")

    def _instantiate(self, klass, args):
        self._new(klass)
        super()._instantiate(klass, args)

    def _target(self):
        obj = self.stack[-1]
        if id(obj) in self.fetched or isinstance(obj, (type, types.ModuleType)):
            raise Refused("refused to change a class, a function or a module")
        return obj

    def load_build(self):
        state = self.stack.pop()
        inst = self._target()
        if _dunders(inst):
            raise Refused(f"refused an object with its own {_dunders(inst)[0]}")
        setstate = getattr(type(inst), "__setstate__", None)
        if setstate is not None:
            setstate(inst, state)
        else:
            slots = None
            if isinstance(state, tuple) and len(state) == 2:
                state, slots = state
            for k, v in (state or {}).items():
                inst.__dict__[sys.intern(k) if type(k) is str else k] = v
            for k, v in (slots or {}).items():
                if not isinstance(k, str) or k.startswith("__"):
                    raise Refused("refused a slot named like a special attribute")
                setattr(inst, k, v)
        if _dunders(inst):
            raise Refused(f"refused state that sets {_dunders(inst)[0]}")

    def load_append(self):
        value = self.stack.pop()
        obj = self._target()
        type(obj).append(obj, value)

    def load_appends(self):
        items = self.pop_mark()
        obj = self._target()
        extend = getattr(type(obj), "extend", None)
        if extend is not None:
            extend(obj, items)
            return
        for item in items:
            type(obj).append(obj, item)

    def load_setitem(self):
        value = self.stack.pop()
        key = self.stack.pop()
        self._target()[key] = value

    def load_setitems(self):
        items = self.pop_mark()
        obj = self._target()
        for i in range(0, len(items), 2):
            obj[items[i]] = items[i + 1]

    def load_additems(self):
        items = self.pop_mark()
        obj = self._target()
        for item in items:
            type(obj).add(obj, item)

    for _op, _fn in (
        (pickle.REDUCE, load_reduce),
        (pickle.NEWOBJ, load_newobj),
        (pickle.NEWOBJ_EX, load_newobj_ex),
        (pickle.BUILD, load_build),
        (pickle.APPEND, load_append),
        (pickle.APPENDS, load_appends),
        (pickle.SETITEM, load_setitem),
        (pickle.SETITEMS, load_setitems),
        (pickle.ADDITEMS, load_additems),
    ):
        dispatch[_op[0]] = _fn
    del _op, _fn


def load(name):
    """The object in workspace file `name`, through `SafeLoader`; a link or a special file is refused."""
    info = os.lstat(name)
    if not stat.S_ISREG(info.st_mode):
        raise Refused("not a regular file (a link, a folder or a special file)")
    if info.st_size == 0:
        raise Refused("an empty file")
    with open(name, "rb") as f:
        return SafeLoader(f).load()


def shape(obj):
    """(kind, rows, columns) of an array or a table; columns None for one dimension, rows None if neither."""
    import numpy as np
    import pandas as pd
    from scipy import sparse

    kind = type(obj).__name__
    if isinstance(obj, pd.DataFrame):
        return kind, len(obj), obj.shape[1]
    if isinstance(obj, pd.Series):
        return kind, len(obj), None
    if sparse.issparse(obj):
        return kind, obj.shape[0], obj.shape[1]
    if isinstance(obj, (list, tuple)):
        try:
            obj = np.asarray(obj)
        except ValueError:
            return kind, None, None  # ragged
    if isinstance(obj, np.ndarray) and obj.ndim in (1, 2):
        return kind, obj.shape[0], obj.shape[1] if obj.ndim == 2 else None
    return kind, None, None


def _rows(rows, want):
    low, high = want["rows"]
    if rows is None or rows < low or rows > high:
        span = f"{low}" if low == high else f"{low} to {high}"
        return f"{rows if rows is not None else 'no'} rows, expected {span}"
    return ""


def judge(obj, want):
    """(receipt fields, why not ok or "") of a loaded object against what its file must hold."""
    kind, rows, columns = shape(obj)
    out = {"kind": kind, "rows": rows, "columns": columns}
    if want["holds"] == "estimator":
        return out, _estimator(obj)
    if want["holds"] == "features" and (columns is None or columns < 1):
        return out, f"{kind}, not a table of features (rows x columns)"
    if want["holds"] == "target" and columns not in (None, 1):
        return out, f"{kind} of {columns} columns, not one target column"
    return out, _rows(rows, want)


def _estimator(obj):
    from sklearn.base import BaseEstimator
    from sklearn.exceptions import NotFittedError
    from sklearn.utils.validation import check_is_fitted

    if not isinstance(obj, BaseEstimator):
        return f"{type(obj).__name__}, not a scikit-learn estimator"
    if not callable(getattr(type(obj), "predict", None)) or not hasattr(obj, "predict"):
        return f"{type(obj).__name__} has no predict method"
    try:
        check_is_fitted(obj)
    except NotFittedError:
        return f"an unfitted {type(obj).__name__}"
    except Exception as e:  # noqa: BLE001 - an estimator whose state cannot be read is no receipt
        return f"{type(obj).__name__}: fitted state unreadable ({type(e).__name__})"
    return ""


def _together(report, expect):
    """Checks across files: y_train as many rows as X_train, X_test as many columns."""
    for name, want in expect.items():
        other = want.get("same_rows_as" if want["holds"] == "target" else "same_columns_as")
        if not other or not report.get(name, {}).get("ok") or not report.get(other, {}).get("ok"):
            continue
        key = "rows" if want["holds"] == "target" else "columns"
        if report[name][key] != report[other][key]:
            mine, theirs = report[name][key], report[other][key]
            report[name].update(ok=False, why=f"{mine} {key}, but {other} has {theirs}")


def check(expect):
    """Print MARKER + the JSON receipts of every file in `expect` (name -> what it must hold)."""
    report = {}
    for name, want in expect.items():
        entry = {"ok": False, "kind": "", "rows": None, "columns": None, "why": ""}
        try:
            obj = load(name)
            fields, why = judge(obj, want)
            entry.update(fields, ok=not why, why=why)
        except FileNotFoundError:
            entry["why"] = "no such file"
        except Refused as e:
            entry["why"] = str(e)[:300]
        except Exception as e:  # noqa: BLE001 - a file that does not load is no receipt, whatever the error
            entry["why"] = f"does not load ({type(e).__name__})"
        report[name] = entry
    _together(report, expect)
    sys.stdout.write(MARKER + json.dumps(report) + "\n")
    sys.stdout.flush()
