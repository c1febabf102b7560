//! `runner data` on instruction data: the first examples as the model sees them, each with its
//! rendered text, its token ids, which of them count in the loss, and the text of those (each
//! text after a bar, line by line, exactly as it is).
use super::{examples, place, Encoder, InstructionsSpec};

/// Prints the first `n` training examples of `spec`.
pub fn show(spec: &InstructionsSpec, n: usize) -> anyhow::Result<()> {
    let (train, _) = examples(spec).map_err(anyhow::Error::msg)?;
    let encoder = Encoder::open(&spec.tokenizer).map_err(anyhow::Error::msg)?;
    for (k, e) in train.iter().take(n).enumerate() {
        let counted: Vec<u32> = e.ids.iter().zip(&e.counted).filter(|(_, &c)| c).map(|(&i, _)| i).collect();
        let cut = if e.cut > 0 { format!(", {} cut off its end", e.cut) } else { String::new() };
        crate::say!(
            "\nexample {} ({}): {} tokens{cut}, {} of them in the loss",
            k + 1,
            place(&spec.path, e.line),
            e.ids.len(),
            counted.len()
        );
        crate::say!("  text:\n{}", framed(&e.text));
        crate::say!("  ids:         {}", e.ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" "));
        crate::say!("  in the loss: {}", e.counted.iter().map(|&c| if c { '1' } else { '0' }).collect::<String>());
        crate::say!("  their text:\n{}", framed(&encoder.tokenizer.decode(&counted)?));
    }
    Ok(())
}

/// `text` line by line after a bar, so that every character shows as it is: the text is the
/// lines after their "  │ " joined by newlines (a last empty line: a text that ends in one).
fn framed(text: &str) -> String {
    text.split('\n')
        .map(|l| if l.is_empty() { "  │".to_owned() } else { format!("  │ {l}") })
        .collect::<Vec<_>>()
        .join("\n")
}
