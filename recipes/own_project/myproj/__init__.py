"""An example user project for tfkv: its own model and its own data, next to its own conf/."""
