//! The resolved configuration as TOML (the run directory's `config.toml`), each value annotated
//! with where it came from, input files as absolute paths.
use super::Plan;

pub fn annotated_toml(plan: &Plan) -> String {
    let value =
        crate::config::schema::with_every_key(|| toml::Value::try_from(&plan.config)).expect("a Config serializes");
    let mut out = format!(
        "# The resolved configuration of run {} (runner {}), from {}.\n\
         # Each value's comment says where it came from: default, file, env, --set or sweep axis.\n",
        plan.run_id,
        env!("CARGO_PKG_VERSION"),
        plan.pipeline_file.display()
    );
    let mut leaves = Vec::new();
    crate::config::resolve::flatten("", &value, &mut leaves);
    let mut section = String::new();
    for (key, v) in leaves {
        let (sec, name) = key.rsplit_once('.').unwrap_or(("", &key));
        if sec != section {
            out += &format!("\n[{sec}]\n");
            section = sec.to_owned();
        }
        let from = plan.sources.get(&key).map(String::as_str).unwrap_or("default");
        // A run in steps has no epochs: the key stays out, so that resuming from this file (with
        // --set train.steps, say) does not give the run's length twice.
        if key == "train.epochs" && plan.config.train.steps.is_some() {
            out += "# epochs: not used, the run counts train.steps\n";
            continue;
        }
        // Relative to the pipeline file when written; absolute here, so that the file stays
        // valid from the run directory (runner run --resume reads it). A glob or a list is
        // written as the files it resolved to.
        let files: Vec<toml::Value> = plan
            .inputs
            .iter()
            .filter(|f| f.key == key)
            .map(|f| toml::Value::String(f.path.display().to_string()))
            .collect();
        let glob = v.as_str().is_some_and(|s| s.contains(['*', '?', '[']));
        let v = match files.len() {
            0 => v,
            1 if !v.is_array() && !glob => files.into_iter().next().expect("one file"),
            // A directory of files (a Hugging Face checkpoint): the directory.
            _ if !v.is_array() && !glob => {
                match plan.inputs.iter().find(|f| f.key == key).and_then(|f| f.path.parent()) {
                    Some(dir) => toml::Value::String(dir.display().to_string()),
                    None => v,
                }
            }
            _ => toml::Value::Array(files),
        };
        out += &format!("{name} = {v}  # {from}\n");
    }
    out
}
