use std::path::{Component, Path};

use crate::CheckpointError;

/// Checks that `name` names a file directly inside `directory`, so that neither a writer nor a
/// manifest can reach outside the checkpoint.
pub(crate) fn check_file_name(directory: &Path, name: &str) -> Result<(), CheckpointError> {
    let mut components = Path::new(name).components();
    match (components.next(), components.next()) {
        (Some(Component::Normal(single)), None) if single == name => Ok(()),
        _ => Err(CheckpointError::BadFileName {
            directory: directory.to_owned(),
            name: name.to_owned(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_names_pass() {
        let dir = Path::new("ckpt");
        assert!(check_file_name(dir, "rank_0.safetensors").is_ok());
        for bad in ["", ".", "..", "../x", "a/b", "/abs", "x/"] {
            assert!(check_file_name(dir, bad).is_err(), "{bad:?}");
        }
    }
}
