"""The configuration, as code: argv -> a validated config, and what every key means.

`config/` (this package, Python) sits beside `configs/` (the shipped ymls, installed as `maxtext_rl_plugin.configs`)
because the two change for different reasons: a yml is data a user copies and edits, this package is the code that
reads any yml. The entry points callers use, each in its owning module (import that module, not this package):

* `precheck.precheck(argv)`: the first pass, on the config as written, before JAX and the schema are imported;
* `load.load_config(argv)` / `load.load_pydantic(argv)`: the typed load (MaxText's pyconfig + `schema.PluginRLConfig`);
* `validation.validate(config)`: every device-free check of a loaded config;
* `key_status.status(key)`: whether a key is honoured (where) or refused (why);
* `doc`: `python -m maxtext_rl_plugin.config.doc > docs/config_reference.md`.

Nothing is imported here: the first pass must not import JAX, which `load` and `schema` do.
"""
