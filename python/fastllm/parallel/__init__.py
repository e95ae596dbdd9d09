"""Parallelism under the model: the mesh and its process groups, and the collectives the
model's layers call. Imports torch and config only; the model takes the mesh, the engine
builds it.

- dimension: one dimension of the mesh (size, this rank's place, its process group)
- mesh: the tensor → data → pipeline mesh with its sequence-data and expert sub-groups
- process_group: joining torchrun's process group (device, rank, world)
- point_to_point: sends and receives between pipeline ranks
- tensor: the tensor dimension and its autograd collectives (enter/leave, vocab-parallel
  embedding and loss), with the weight-gradient queue its backward collective overlaps
- sequence_data: the sequence-data dimension (which chunks a rank computes) and the K/V gather
- expert: the expert all-to-all of the mixtures of experts
"""
