//! The mesh's process groups as the strategies use them: one per dimension, built once.
use crate::config::schema::WrapStrategy;
use std::sync::Arc;

use crate::dist::ProcessGroup;
use crate::plan::Plan;

/// `pg`'s rank's group along the mesh dimension `dim` (every rank calls it at the same point, for
/// the same dimensions): `None` where the dimension is one rank.
pub(super) fn mesh_group(
    pg: &ProcessGroup,
    mesh: &crate::plan::mesh::Shape,
    dim: crate::plan::mesh::Dim,
) -> crate::dist::Result<Option<ProcessGroup>> {
    let size = mesh.size(dim);
    if size == 1 {
        return Ok(None);
    }
    let members = mesh.group(pg.rank(), dim);
    // Named by the group's first rank: one name per group, the same on each of its members.
    pg.subgroup(&format!("{dim:?}{}", members[0]).to_lowercase(), &members).map(Some)
}

/// The mesh's process groups that tensor parallelism adds, built once before the model: the
/// tensor group (the ranks that split each layer) and the data group (the copies of the model
/// whose gradients DDP averages). Without tensor parallelism there are none: the data
/// dimension is every rank (a pipeline builds its own copies' groups).
#[derive(Default)]
pub struct MeshGroups {
    data: Option<ProcessGroup>,
    /// Shared with the tensor parallel layers, whose recomputation (activation checkpointing)
    /// outlives any borrow of the step.
    tensor: Option<Arc<ProcessGroup>>,
}

impl MeshGroups {
    /// Every rank calls this at the same point.
    pub fn new(plan: &Plan, pg: &ProcessGroup) -> crate::dist::Result<MeshGroups> {
        let mesh = plan.mesh();
        if mesh.tensor == 1 {
            return Ok(MeshGroups::default());
        }
        let group = |dim: crate::plan::mesh::Dim| {
            let members = mesh.group(pg.rank(), dim);
            // A data group of one rank is built too: DDP then has no peer, as at world size 1.
            pg.subgroup(&format!("{dim:?}{}", members[0]).to_lowercase(), &members)
        };
        // A pipeline averages each stage's gradients over its copies in a data group of its own.
        let data = match plan.config.wrap.strategy {
            WrapStrategy::Pipeline => None,
            _ => Some(group(crate::plan::mesh::Dim::Data)?),
        };
        Ok(MeshGroups { data, tensor: Some(Arc::new(group(crate::plan::mesh::Dim::Tensor)?)) })
    }

    /// The ranks that hold copies of this rank's part of the model: the data group, or `world`.
    pub fn data<'a>(&'a self, world: &'a ProcessGroup) -> &'a ProcessGroup {
        self.data.as_ref().unwrap_or(world)
    }

    pub fn tensor(&self) -> Option<&Arc<ProcessGroup>> {
        self.tensor.as_ref()
    }
}
