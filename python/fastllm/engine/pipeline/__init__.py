"""Pipeline parallelism: the static schedule of a step (`schedule`), its execution on one
rank (`runner`) and its simulation under a cost model (`simulator`)."""
