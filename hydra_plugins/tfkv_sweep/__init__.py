"""tfkv's Hydra plug-ins: Hydra instantiates launchers and sweepers only from the
`hydra_plugins` namespace package, so these modules re-export classes that live in tfkv.sweep."""
