"""Makes plain ``lm_eval --model unmask`` work: registers unmask's model with lm-eval.

Released lm-eval (0.4.13) finds models only in its own ``lm_eval.models`` (its MODEL_MAPPING);
it does not read the ``lm_eval.models`` entry point unmask declares. So unmask installs
``unmask_lm_eval.pth`` at the root of site-packages, whose one line runs :func:`install` at every
interpreter start. That puts a finder at the front of ``sys.meta_path`` which does nothing until
``lm_eval.models`` is imported; right after that module has run (lm-eval's built-in models are
registered by then), it registers ``unmask`` as a lazy placeholder for
``unmask.evaluation.harness:UnmaskLM``: nothing of unmask (nor torch) is imported until lm-eval
asks for the model.

Rules this module keeps, since it runs in every Python process of the environment:

- at import it loads nothing but ``sys``; a process that never imports ``lm_eval`` pays one
  string comparison per import;
- it registers only after ``lm_eval.models``, never before: lm-eval's ``get_model`` imports
  ``lm_eval.models`` only while its registry is empty, so an early ``unmask`` would hide every
  built-in model;
- it is a no-op where lm-eval already knows ``unmask`` (a future built-in) or discovers
  ``lm_eval.models`` entry points itself (``lm_eval.api.registry.load_plugins``);
- its own failures are warnings, never errors.
"""

import sys

WATCHED = "lm_eval.models"
MODEL = "unmask"
TARGET = "unmask.evaluation.harness:UnmaskLM"


def register() -> bool:
    """Register ``unmask`` in lm-eval's model registry unless lm-eval knows it or finds it itself.
    True if it registered. Needs ``lm_eval.models`` imported (else built-ins would be hidden)."""
    from lm_eval.api import registry

    if MODEL in registry.model_registry or hasattr(registry, "load_plugins"):
        return False
    registry.model_registry.register(MODEL, target=TARGET)
    return True


def _register_or_warn() -> None:
    try:
        register()
    except Exception as e:  # never break lm-eval over this
        _warn(e)


def _warn(e: BaseException) -> None:
    try:
        import warnings

        warnings.warn(f"unmask could not register lm-eval's `--model unmask` ({type(e).__name__}: "
                      f"{e}); the `unmask-lm-eval` command registers it itself", RuntimeWarning,
                      stacklevel=2)
    except Exception:
        pass


class _Loader:
    """The real loader of ``lm_eval.models``, plus the registration once the module has run."""

    def __init__(self, finder: "_Finder", loader) -> None:
        self._finder = finder
        self._loader = loader

    def __getattr__(self, name: str):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            # From here on the module looks as if it had been loaded without this hook.
            module.__loader__ = self._loader
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self._loader
        self._finder.uninstall()
        _register_or_warn()


class _Finder:
    """Meta path finder that wraps the loader of ``lm_eval.models`` (and answers nothing else)."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != WATCHED:
            return None
        try:
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
            if spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            spec.loader = _Loader(self, spec.loader)
            return spec
        except Exception as e:
            _warn(e)
            return None

    def uninstall(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def install() -> None:
    """Called by ``unmask_lm_eval.pth`` at interpreter start. Idempotent."""
    try:
        if WATCHED in sys.modules:  # too late for the hook: lm-eval's models are registered
            _register_or_warn()
            return
        if not any(type(f).__name__ == "_Finder" and type(f).__module__ == __name__
                   for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
    except Exception as e:
        _warn(e)
