"""Starting every role of a parameter-server job: a plan (which role where), then a backend
that runs it. The launcher never imports TensorFlow."""
