//! `[load]`, `[shard]` and `[normalize]`: where the data comes from, how it is split over the
//! ranks and how it is scaled.
use super::*;

/// `[load]`: the data, generated or read from files.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Load {
    /// Where the samples come from: generated, a file of rows, arrays, or tokens.
    pub source: Source,
    /// Training rows (synthetic); for files, the rows read (all when absent).
    pub rows: Option<usize>,
    /// Synthetic: the number of features. Files: the feature columns, in order (default: every
    /// column but the target and `exclude`); a number is checked against the file's count.
    pub features: Option<Features>,
    /// Files: columns left out of the features (an ID column, a leak).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub exclude: Vec<String>,
    /// Number of classes (synthetic); for files, inferred from the target column when absent.
    pub classes: Option<usize>,
    /// Synthetic only: rows generated after the training rows for validation (files:
    /// `validate.fraction`, `validate.rows` or `load.validation_path`).
    pub validation_rows: usize,
    /// Synthetic only: scale of the label noise (0 = a noiseless teacher).
    pub noise: f64,
    /// The data file, relative to the pipeline file. Token files (`source = "tokens"` or
    /// `"text"`) may be several: a list of paths or a glob (`"data/train-*.bin"`), read as one
    /// stream in sorted order.
    pub path: Option<Paths>,
    /// csv / parquet: the column to predict: class labels (integers, strings or booleans, mapped to
    /// class ids in sorted order) or, with `train.task = "regression"`, numbers.
    pub target: Option<String>,
    /// Synthetic only: generate images of this shape, [channels, height, width], instead of rows
    /// of `features` numbers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<[usize; 3]>,
    /// tensors with an .npy `path` (the inputs, `x`) only: the .npy file of the labels (`y`),
    /// relative to the pipeline file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub labels: Option<PathBuf>,
    /// A separate validation file (instead of a split): the same columns (csv / parquet), the same
    /// arrays (tensors), a token file such as nanoGPT's `val.bin` (tokens, text), or a JSON Lines
    /// or parquet file of examples (instructions).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub validation_path: Option<PathBuf>,
    /// Language models: how each step's windows are drawn. "epoch": DistributedSampler over fixed
    /// windows; "random": every step, each rank draws its windows at uniformly random token
    /// offsets (nanoGPT's get_batch), seeded by (run.seed, step, rank).
    #[serde(skip_serializing_if = "is_default")]
    pub sampling: Sampling,
    /// csv / parquet: what to do with missing cells (empty, NA, N/A, null).
    #[serde(skip_serializing_if = "Missing::is_error")]
    pub missing: Missing,
    /// csv: the field separator, one character (default ",").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delimiter: Option<String>,
    /// instructions: the directory of the tokenizer (`tokenizer.json`, and `tokenizer_config.json`
    /// with its `chat_template` for `messages`), relative to the pipeline file; default: the
    /// directory of `load.path`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// instructions: an example longer than `wrap.model.seq_len` + 1 tokens: "error" refuses it
    /// (its file and line), "truncate" keeps its first tokens (counted in the plan).
    #[serde(skip_serializing_if = "is_default")]
    pub too_long: TooLong,
    /// instructions: pack examples, in the file's order, into windows of `wrap.model.seq_len`
    /// (each example attending only to itself, its positions from 0) instead of padding each.
    #[serde(skip_serializing_if = "is_default")]
    pub packing: bool,
}

/// `load.too_long`: an instruction example longer than the model's context.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum TooLong {
    /// Refuse the data, naming the file, the line and the example's length.
    #[default]
    Error,
    /// Keep the example's first seq_len + 1 tokens (the plan counts how many were cut).
    Truncate,
}

/// `load.path`: one file, or (token files) several, or a glob.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum Paths {
    One(PathBuf),
    Many(Vec<PathBuf>),
}

impl Paths {
    /// The single path, or `None` for a list.
    pub fn single(&self) -> Option<&PathBuf> {
        match self {
            Paths::One(p) => Some(p),
            Paths::Many(_) => None,
        }
    }
}

impl From<&str> for Paths {
    fn from(p: &str) -> Paths {
        Paths::One(p.into())
    }
}

/// `load.sampling`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Sampling {
    #[default]
    Epoch,
    Random,
}

/// `load.features`: a count (synthetic) or column names (files).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum Features {
    Count(usize),
    Columns(Vec<String>),
}

/// `load.missing`: missing cells in a data file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Missing {
    /// Refuse the file, naming the columns and counts.
    #[default]
    Error,
    /// Leave out every row with a missing cell.
    Drop,
    /// Fill numeric cells with the training rows' mean (categorical cells: no category).
    Mean,
    /// Fill numeric cells with the training rows' median (categorical cells: no category).
    Median,
    /// Fill numeric cells with 0 (categorical cells: no category).
    Zero,
}

impl Missing {
    fn is_error(&self) -> bool {
        *self == Missing::Error
    }
}

impl Default for Load {
    fn default() -> Self {
        Load {
            source: Source::Synthetic,
            rows: None,
            features: None,
            classes: None,
            validation_rows: 1000,
            noise: 0.5,
            path: None,
            target: None,
            image: None,
            labels: None,
            exclude: Vec::new(),
            validation_path: None,
            sampling: Sampling::Epoch,
            missing: Missing::Error,
            delimiter: None,
            tokenizer: None,
            too_long: TooLong::Error,
            packing: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Synthetic,
    Csv,
    Parquet,
    /// Arrays `x` (any shape, first axis = rows) and `y` (integer labels): an .npz or
    /// .safetensors file, or an .npy file of `x` with `load.labels` the .npy file of `y`.
    Tensors,
    /// A flat array of token ids (`.npy`, or raw little-endian uint16 `.bin` as nanoGPT writes
    /// it), cut into windows of `wrap.model.seq_len` + 1 for a language model.
    Tokens,
    /// Any UTF-8 file read as bytes (token ids 0..256), cut into windows like `tokens`.
    Text,
    /// Instruction data for supervised fine-tuning: JSON Lines (or parquet columns, for a path
    /// ending in `.parquet`) of `prompt`/`response` pairs or chat `messages`, tokenized with `load.tokenizer`, the loss on the responses only, each
    /// example padded to `wrap.model.seq_len` (or packed: `load.packing`).
    Instructions,
}

/// `[shard]`: how the training samples divide across the ranks, epoch after epoch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Shard {
    /// How each step's samples divide across the ranks.
    pub strategy: ShardStrategy,
    /// Reshuffle every epoch (DistributedSampler's set_epoch); otherwise the file order.
    pub shuffle: bool,
    /// Drop the tail that does not divide by world_size; otherwise pad by repeating rows
    /// (trained on, never counted twice in metrics).
    pub drop_last: bool,
}

impl Default for Shard {
    fn default() -> Self {
        Shard { strategy: ShardStrategy::Dataset, shuffle: true, drop_last: false }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ShardStrategy {
    /// DistributedSampler: rank r takes positions r, r+W, r+2W, ... of each epoch's permutation.
    Dataset,
    /// Every global batch (train.global_batch_size) split evenly across the ranks.
    Batch,
}

/// `[normalize]`: how the inputs are scaled before training.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Normalize {
    /// How each input is scaled, with statistics fitted on the training rows only (a column
    /// constant over them gets scale 1).
    pub method: NormalizeMethod,
    /// Whose rows the statistics are fitted on.
    pub scope: NormalizeScope,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NormalizeMethod {
    /// Scale each feature to [0, 1].
    #[default]
    Minmax,
    /// Zero mean, unit variance per feature.
    Standard,
    None,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NormalizeScope {
    /// Statistics of the rank's own shard (what the seed does; a column constant in one shard
    /// gets scale 1 there).
    Rank,
    /// Statistics all-reduced across ranks: the whole training set, the same at every world size.
    #[default]
    Global,
}
