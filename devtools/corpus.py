"""The demo model's training text: documentation that ships with Python itself (PSF licence),
so it is on every machine with no download. Deterministic for a given Python version: the pydoc
topics in key order, then the docstrings of a fixed list of stdlib modules, deduplicated and sorted
(never in set or dict order, which `PYTHONHASHSEED` changes).

Libraries patch stdlib objects when imported (torch replaces `inspect.getfile`, transformers adds
methods to `logging.Logger`), so `python -m tgq.devtools.corpus` builds the corpus in a process that
imported nothing else, and prints it as JSON; `load_corpus` runs it in a child."""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import tgq

# Pure-Python or stable C modules with plenty of prose in their docstrings; a fixed list, so the
# corpus does not depend on what else happens to be importable.
_MODULE_NAMES = """
abc argparse ast asyncio base64 bisect calendar cmd codecs collections concurrent.futures
configparser contextlib copy csv dataclasses datetime decimal difflib doctest email enum filecmp
fnmatch fractions ftplib functools getopt gettext glob graphlib gzip hashlib heapq hmac html
http.client http.server imaplib inspect io ipaddress itertools json logging mailbox math
mimetypes numbers operator optparse os pathlib pdb pprint pydoc queue random re sched secrets
selectors shelve shlex shutil smtplib socket sqlite3 statistics string struct subprocess tarfile
tempfile textwrap threading timeit tokenize traceback types typing unittest urllib.parse
urllib.request uuid warnings weakref wave xml.dom.minidom xml.etree.ElementTree zipfile zoneinfo
"""
STDLIB_MODULES = tuple(_MODULE_NAMES.split())
MIN_DOC_CHARS = 40  # shorter ones are mostly "Return self.x." boilerplate


def pydoc_topics() -> list[str]:
    """The language reference sections `help()` shows, from `pydoc_data`."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def documented_objects(module: ModuleType) -> list[object]:
    """The module, its public classes and functions, and those classes' public members."""
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    objects: list[object] = [module]
    for name in sorted(names):
        value = getattr(module, name, None)
        if inspect.isclass(value):
            objects.append(value)
            objects += [v for k, v in sorted(vars(value).items()) if not k.startswith("_")]
        elif inspect.isroutine(value):
            objects.append(value)
    return objects


def is_stdlib(obj: object) -> bool:
    """Defined by the standard library (builtin methods have no `__module__`)."""
    module = getattr(obj, "__module__", None)
    return module is None or module.partition(".")[0] in sys.stdlib_module_names


def docstring(obj: object) -> str | None:
    """`obj`'s cleaned docstring, or None when it has none worth learning from (too short, or
    generated with an object's address in it, which differs from run to run)."""
    is_documented = inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj)
    if not (is_documented and is_stdlib(obj)):
        return None
    doc = inspect.getdoc(obj)
    if not doc or len(doc) < MIN_DOC_CHARS or " at 0x" in doc:
        return None
    return doc


def stdlib_docstrings(module_names: tuple[str, ...] = STDLIB_MODULES) -> list[str]:
    """Each distinct docstring once (re-exported objects share theirs), sorted."""
    docs = set()
    for name in module_names:
        for obj in documented_objects(importlib.import_module(name)):
            doc = docstring(obj)
            if doc is not None:
                docs.add(doc)
    return sorted(docs)


def corpus_texts() -> list[str]:
    """The whole corpus, one document per entry (as this process's modules are now)."""
    return pydoc_topics() + stdlib_docstrings()


def load_corpus() -> list[str]:
    """`corpus_texts()` from a fresh interpreter, untouched by what this process imported."""
    command = [sys.executable, "-m", "tgq.devtools.corpus"]
    # From the folder that holds `tgq` (site-packages, or the repository): never from inside it.
    root = Path(tgq.__file__).parent.parent
    done = subprocess.run(command, check=True, capture_output=True, text=True, cwd=root)
    texts: list[str] = json.loads(done.stdout)
    return texts


if __name__ == "__main__":
    json.dump(corpus_texts(), sys.stdout)
