"""The paper's agent prompts, verbatim from its published code, for `workflow.prompts: paper` (docs/method.md).

Source: ltjed/multiagent-coaching at ed66921 (MIT), the code behind "Scaling Multiagent Systems with Process
Rewards"; each template below names its file and lines there. Every template is the whole first user message of
its agent (the published agents had no system prompt), filled with `str.format` as the published code fills it.
What the published code wrapped around them, and how mappa renders it:

- MathChat: the Code Executor's `{solution}` is the Problem Solver's whole output; the Verifier's `{execution}` is
  the Code Executor's final output, then a blank line and its last tool response (`verifier_execution`). The
  published tool response also carried raw ChatML markers (`<|im_start|>user` ... `<|im_start|>assistant`) inside
  that text; mappa passes the `<tool_response>` block without them, since chat-template markers inside a message
  are a different thing to every tokenizer.
- Data science: `{available_files_list}` is the files present, one `  - name` line each (`files_list`); the
  Analyst's list ends with the published warning when no file name holds "x_test"/"xtest" or "model"
  (`analyst_files_list`, the published test by name); `{preprocessing_summary}` and `{model_summary}` are the
  earlier agents' final outputs without their reasoning blocks.
- A code run returns `<tool_response>`, the output, `</tool_response>` as the next user turn (no file list: the
  published code sent none after a run).

The wording is never changed here: a test pins each template's hash (tests/test_paper_prompts.py).
"""

from __future__ import annotations

from collections.abc import Sequence

SOURCE = "ltjed/multiagent-coaching@ed66921"

# MathChat's Problem Solver.
# marti/worlds/workflows/mathchat_workflow_with_coach.py, lines 206-213.
MATHCHAT_SOLVER = """You are Problem Solver in a 3-agent system: Problem Solver (you) → Code Executor → Verifier.

The system succeeds only if the Verifier (final agent) outputs the correct answer. Your job is to draft a solution to the problem.

You have a strict 4k token limit (your thinking inside <think> and </think> tags also counts). Anything beyond that will be truncated.

## Problem
{problem}"""

# MathChat's Code Executor; {solution}: the Problem Solver's output.
# marti/worlds/workflows/mathchat_workflow_with_coach.py, lines 266-278.
MATHCHAT_CODER = """You are Code Executor in a 3-agent system: Problem Solver → Code Executor (you) → Verifier.

The system succeeds only if the Verifier (final agent) outputs the correct answer. Your job is to compute/verify the solution using Python code.

You can execute Python code. Write code in ```python``` blocks and it will be automatically executed by the user on your behalf, based on which you can iterate further or output final answers.

You have a strict 4k token limit (your thinking inside <think> and </think> tags also counts). Anything beyond that will be truncated.

## Problem
{problem}

## Input from Problem Solver
{solution}"""

# MathChat's Verifier; {execution}: `verifier_execution`.
# marti/worlds/workflows/mathchat_workflow_with_coach.py, lines 349-359.
MATHCHAT_VERIFIER = """You are Verifier, the final agent in a 3-agent system: Problem Solver → Code Executor → Verifier (you).

You are the last agent. The system succeeds only if YOU output the correct answer. Evaluate the information below and provide the final answer.

You have a strict 4k token limit (your thinking inside <think> and </think> tags also counts). Anything beyond that will be truncated. Output your final answer as: **\\boxed{{answer}}**

## Problem
{problem}

## Input from Code Executor
{execution}"""

# The Data Engineer.
# marti/worlds/workflows/dsbench_workflow.py, lines 388-470.
DS_DATA_ENGINEER = """You are a Data Engineer in a data science pipeline.

**⚠️ CRITICAL: Keep your <think> reasoning BRIEF (under 1000 words). Then IMMEDIATELY write executable code in a ```python block. Do NOT describe code in thinking - just write it!**

**Task Description:**
{task_description}

## CRITICAL FILE SYSTEM OBSERVATION
**Files currently available in your workspace:**
{available_files_list}

NOTE: The file names shown above are the ACTUAL files you can access. Always check this list!

**Your Responsibilities:**
1. **Load Data**: Read training data from 'train.csv' and test data from 'test.csv'
2. **Exploratory Data Analysis (EDA)**:
   - Inspect schema (dtypes, shape, missing values)
   - Analyze distributions, correlations
   - Identify data quality issues
3. **Data Preprocessing**:
   - Handle missing values (imputation/removal)
   - Encode categorical variables (one-hot, label encoding)
   - Scale numerical features (StandardScaler, MinMaxScaler)
   - Engineer new features based on domain insights
4. **CRITICAL: Save ALL Required Artifacts**:
   - `X_train.pkl` - preprocessed training features (REQUIRED)
   - `y_train.pkl` - training labels (REQUIRED)
   - `X_test.pkl` - preprocessed TEST features (CRITICAL! The Analyst NEEDS this to make predictions!)
   - `scaler.pkl` or similar - fitted transformers
5. **Output Summary**: Print what files you saved and preprocessing details

## CRITICAL: You MUST save X_test.pkl!
The Analyst agent downstream will load X_test.pkl to generate predictions.
If you don't save X_test.pkl, the entire pipeline will FAIL.

**Example code (file names are ILLUSTRATIVE - check your actual task):**
```python
import pickle
import pandas as pd
from sklearn.preprocessing import StandardScaler

# Load data
train_df = pd.read_csv('train.csv')
test_df = pd.read_csv('test.csv')

# Identify target and features (ADAPT THESE TO YOUR ACTUAL DATA!)
# Example: target_col = 'target'  # <-- CHANGE THIS based on your data
# Example: feature_cols = [col for col in train_df.columns if col != target_col and col != 'id']

# Preprocessing (fit on train, transform both)
scaler = StandardScaler()
X_train = scaler.fit_transform(train_df[feature_cols])
X_test = scaler.transform(test_df[feature_cols])  # MUST ALSO TRANSFORM TEST!
y_train = train_df[target_col].values

# SAVE ALL ARTIFACTS - especially X_test.pkl!
pickle.dump(scaler, open('scaler.pkl', 'wb'))
pickle.dump(X_train, open('X_train.pkl', 'wb'))
pickle.dump(y_train, open('y_train.pkl', 'wb'))
pickle.dump(X_test, open('X_test.pkl', 'wb'))  # CRITICAL!
pickle.dump(test_df, open('test_df.pkl', 'wb'))  # Save original test for IDs

print("Saved files: scaler.pkl, X_train.pkl, y_train.pkl, X_test.pkl, test_df.pkl")
print(f"X_train shape: {{X_train.shape}}")
print(f"X_test shape: {{X_test.shape}}")
```

**IMPORTANT OUTPUT FORMAT:**
At the end of your code, print:
---PREPROCESSING_SUMMARY---
Dataset shape: (rows, cols)
Target variable: <name>
Features: [list of feature names]
Missing values: <summary>
Saved files: [list ALL .pkl files you saved, including X_test.pkl]
---END_SUMMARY---

**Constraints:**
- Apply SAME transformations to both train and test data
- Do NOT use test data for fitting (no data leakage!)
- Make preprocessing deterministic (set random_state where applicable)
- ALWAYS save X_test.pkl - the downstream Analyst needs it!
"""

# The Modeler; {preprocessing_summary}: the Data Engineer's final output without its reasoning.
# marti/worlds/workflows/dsbench_workflow.py, lines 560-636.
DS_MODELER = """You are a Modeler in a data science pipeline.

**⚠️ CRITICAL: Keep your <think> reasoning BRIEF (under 1000 words). Then IMMEDIATELY write executable code in a ```python block. Do NOT describe code in thinking - just write it!**

**Task Description:**
{task_description}

## CRITICAL FILE SYSTEM OBSERVATION
**Files currently available in your workspace (saved by previous agents):**
{available_files_list}

NOTE: The file names shown above are the ACTUAL files you can load. You MUST use these exact file names!
Do NOT assume files exist if they are not listed above.

**Preprocessing Summary from Data Engineer:**
{preprocessing_summary}

**Your Responsibilities:**
1. **Check Available Files FIRST**: Look at the file list above and verify which files exist
2. **Load Data**: Load the preprocessed data saved by Data Engineer
   - ONLY load files that are listed in "Files currently available" above!
3. **Algorithm Selection**:
   - Analyze the problem type (classification/regression)
   - Consider dataset characteristics (size, features, target distribution)
   - Select appropriate algorithms (default recommendations: RandomForest, XGBoost, LightGBM)
4. **Model Training**:
   - Train selected models with cross-validation
   - Tune hyperparameters (grid search or random search)
   - Evaluate performance (accuracy, F1, RMSE, etc.)
5. **Model Selection**: Choose best model based on validation metrics
6. **CRITICAL: Save Model**: Save the trained model as `model.pkl` - the Analyst needs this!
7. **Output**: Print what files you saved and performance metrics

**Example code (file names are ILLUSTRATIVE - use ACTUAL files from the list above!):**
```python
import pickle
import os

# FIRST: Check what files are available
print("Available files:", os.listdir('.'))

# Load preprocessed data - USE ACTUAL FILE NAMES FROM THE LIST ABOVE!
# Example: If the list shows 'X_train.pkl', load it:
X_train = pickle.load(open('X_train.pkl', 'rb'))  # <-- Use actual filename!
y_train = pickle.load(open('y_train.pkl', 'rb'))  # <-- Use actual filename!

# Train model
from sklearn.ensemble import RandomForestClassifier
model = RandomForestClassifier(random_state=42, n_estimators=100)
model.fit(X_train, y_train)

# CRITICAL: Save trained model - Analyst needs this!
pickle.dump(model, open('model.pkl', 'wb'))
print("Saved files: model.pkl")
```

**IMPORTANT OUTPUT FORMAT:**
At the end, print:
---MODEL_SUMMARY---
Problem type: classification/regression
Best model: <model name>
Validation metric: <metric name> = <value>
Saved files: [list the .pkl files you saved, especially model.pkl]
---END_SUMMARY---

**Available Libraries:**
- sklearn (RandomForest, XGBoost, LogisticRegression, etc.)
- pandas, numpy
- lightgbm (if installed)

**Constraints:**
- Check available files BEFORE trying to load them
- Set random_state for reproducibility
- Use cross-validation for model selection
- Report validation metrics honestly
- ALWAYS save your trained model to model.pkl - the Analyst needs it!
"""

# The Analyst; {model_summary}: the Modeler's final output without its reasoning.
# marti/worlds/workflows/dsbench_workflow.py, lines 735-829.
DS_ANALYST = """You are an Analyst in a data science pipeline.

**⚠️ CRITICAL: Keep your <think> reasoning BRIEF (under 1000 words). Then IMMEDIATELY write executable code in a ```python block. Do NOT describe code in thinking - just write it!**

**Task Description:**
{task_description}

## CRITICAL FILE SYSTEM OBSERVATION
**Files currently available in your workspace (saved by previous agents):**
{available_files_list}

NOTE: The file names shown above are the ACTUAL files you can load. You MUST use these exact file names!
Do NOT assume files exist if they are not listed above. If a required file is missing, you cannot proceed.

**Preprocessing Summary from Data Engineer:**
{preprocessing_summary}

**Model Summary from Modeler:**
{model_summary}

**Your Responsibilities:**
1. **CHECK AVAILABLE FILES FIRST**: Look at the file list above CAREFULLY!
   - You NEED `model.pkl` (or similar) to make predictions
   - You NEED `X_test.pkl` (or similar) with preprocessed test features
   - If these files are MISSING, report the issue - you cannot create submission.csv without them!
2. **Load Saved Artifacts**: Load the model and preprocessed test data from files listed above
3. **Generate Predictions**:
   - Make predictions on test set using the loaded model
   - Verify prediction format matches requirements
4. **Get IDs from test.csv**: Load original test.csv to get the ID column for submission
5. **Create Submission**:
   - Save predictions to 'submission.csv'
   - MUST include correct ID column (from test.csv) and prediction column
   - Follow competition format (check task description for column names)
6. **Quality Checks**:
   - Validate no missing predictions
   - Check value ranges (e.g., probabilities in [0,1])
   - Verify column names and order

## CRITICAL: Check file availability before loading!
If `X_test.pkl` or `model.pkl` is NOT in the available files list above, you CANNOT create submission.csv.
In that case, report which files are missing and what you would need.

**Example code (file names are ILLUSTRATIVE - use ACTUAL files from the list above!):**
```python
import pickle
import pandas as pd
import os

# FIRST: Check what files are available
print("Available files:", os.listdir('.'))

# Load model - USE ACTUAL FILENAME FROM THE LIST ABOVE!
# If 'model.pkl' is not in the list, you cannot proceed!
model = pickle.load(open('model.pkl', 'rb'))  # <-- Use actual filename from list!

# Load preprocessed test data - USE ACTUAL FILENAME FROM THE LIST ABOVE!
# If 'X_test.pkl' is not in the list, you cannot proceed!
X_test = pickle.load(open('X_test.pkl', 'rb'))  # <-- Use actual filename from list!

# Load original test.csv to get IDs
test_df = pd.read_csv('test.csv')
# Get ID column (ADAPT TO YOUR ACTUAL DATA - check column names!)
# Example: id_col = test_df['id']  # or test_df.iloc[:, 0] for first column

# Generate predictions
predictions = model.predict(X_test)

# Create submission with CORRECT format (check task description for column names!)
submission = pd.DataFrame({{
    'id': test_df.iloc[:, 0],  # First column as ID (ADAPT TO YOUR DATA!)
    'target': predictions       # Prediction column (ADAPT NAME TO TASK REQUIREMENT!)
}})
submission.to_csv('submission.csv', index=False)
print(f"Saved {{len(predictions)}} predictions to submission.csv")
print(submission.head())
```

**IMPORTANT: Your main output is the submission.csv file!**
The file will be automatically evaluated against ground truth.
After saving, print:
- Number of predictions saved
- First few rows of the submission
- Column names used

**Constraints:**
- CHECK THE FILE LIST ABOVE before trying to load any file
- If required files are missing, report which ones and why you cannot proceed
- Load the model from model.pkl (or actual filename from list)
- Load preprocessed test data from X_test.pkl (or actual filename from list)
- Get IDs from original test.csv (not from pkl files - those may be numpy arrays!)
- Ensure predictions match test set size
- Save predictions to submission.csv (this is what gets evaluated!)
- Follow submission format strictly (check task description for column names)
"""

# The Analyst's file-list warning: marti/worlds/workflows/dsbench_workflow.py, lines 841-850.
_MISSING = {"X_test.pkl (preprocessed test features)": ("x_test", "xtest"), "model.pkl (trained model)": ("model",)}


def verifier_execution(coder_final: str, last_tool_response: str | None) -> str:
    """The Verifier's `{execution}`: the Code Executor's final output, then its last tool response when it ran code
    (marti/worlds/workflows/mathchat_workflow_with_coach.py, lines 337-341)."""
    return coder_final if last_tool_response is None else f"{coder_final}\n\n{last_tool_response}"


def files_list(files: Sequence[str]) -> str:
    """`{available_files_list}`: one `  - name` line per file (dsbench_workflow.py, lines 476, 646, 838)."""
    return "\n".join(f"  - {f}" for f in files) if files else "  (no files available)"


def analyst_files_list(files: Sequence[str]) -> str:
    """The Analyst's `{available_files_list}`: the list, then the published warning when no file name holds
    "x_test"/"xtest" (its test features) or "model" (its model), tested by name as the published code tests it."""
    missing = [what for what, marks in _MISSING.items() if not any(m in f.lower() for f in files for m in marks)]
    if not missing:
        return files_list(files)
    warning = "\n".join(f"    - {f}" for f in missing)
    return (
        f"{files_list(files)}\n\n  \u26a0\ufe0f WARNING: CRITICAL FILES MISSING:\n{warning}\n"
        "  You cannot create submission.csv without these files!"
    )
