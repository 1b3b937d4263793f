"""The paper's coach prompts, verbatim from its published code: the `mathchat_paper` and `ds_pipeline_paper`
templates of `mappa.coach.prompts` (`coach.template`) are these texts.

Source: ltjed/multiagent-coaching at ed66921 (MIT); each text names its file and lines there. Both are `str.format`
templates whose fields the published coach filled from the action (`mappa.coach.prompts` fills them from a
`CoachContext`, every agent-written value fenced as evidence). The wording is never changed here: a test pins
each text's hash (tests/test_coach.py).
"""

from __future__ import annotations

# marti/cli/configs/mathchat_with_coach.yaml, lines 56-108 (workflow_args.coach_prompt_template).
MATHCHAT = """You are evaluating a specific agent in a multi-agent system that collaboratively solves a math competition problem.
The system has 3 specialized agents working sequentially:

1. **Problem Solver**: Reasons through the problem step-by-step
2. **Code Executor**: Writes and executes Python code to verify/compute solutions
3. **Verifier**: Synthesizes the code executor's output and provides the final answer.

The success of the overall system is determined by the Verifier's final answer.

**Workflow Constraints:**
- Each agent has a 4K token output limit. Outputs beyond this are truncated.
- All agents can see the original problem statement.

When evaluating, consider whether the agent:
- (IMPORTANT) Performed well given their role and the information provided
- Stayed within output length limit

**Problem that the overall system is solving:**
{problem}

**Current agent being evaluated:**
{agent_role}

**What the agent received as input:**
{agent_input}

**What the agent outputted:**
{agent_output}

**Environment feedback for the agent's tool call (if applicable):**
{tool_observation}

**Ground truth answer (if applicable):**
{ground_truth_answer}

Evaluate the agent's decision quality based on:
- Given the agent's role and the information it had as input, how helpful is its output towards the overall system's success?
- For Code Executor: Did it output code in the right format? Is the code syntactically correct and does it solve the problem?
- For Verifier: Did it correctly synthesize the information and output the final answer?

Strictly assigns a score from 0 (terrible) to 10 (perfect).

Additionally, if ground truth is provided (not "N/A") and the agent is "Verifier", you MUST also verify answer correctness:

Provide binary correctness as:
- ANSWER_CORRECT: 1 (if the Verifier's final answer matches the ground truth)
- ANSWER_CORRECT: 0 (if the Verifier's final answer is incorrect)

Structure your output in the following format exactly:

PROCESS_SCORE: [0 to 10]
ANSWER_CORRECT: [0 or 1, but only if ground truth provided and agent is Verifier]
"""

# marti/cli/configs/dsbench_ds_pipeline.yaml, lines 64-272 (workflow_args.coach_prompt_template).
DS_PIPELINE = """You are evaluating a specific agent in a multi-agent data science system that collaboratively solves data science tasks.
The system has 3 specialized agents working sequentially:

1. **Data Engineer**: Performs EDA, data cleaning, feature engineering
   - MUST save: `X_train.pkl`, `y_train.pkl`, `X_test.pkl` (preprocessed test data is CRITICAL for Analyst)
2. **Modeler**: Selects algorithms, trains models, tunes hyperparameters
   - MUST save: `model.pkl`
3. **Analyst**: Generates predictions, verifies format, creates submission
   - MUST save: `submission.csv` (this is the FINAL DELIVERABLE)

**Current agent:**
{agent_name}

**Task that the overall system is solving:**
{problem}

**Role of the current agent:**
{agent_role}

**FILES AVAILABLE TO THIS AGENT (what they could load):**
{files_available}

**FILES SAVED BY PREVIOUS AGENTS:**
{files_from_previous_agents}

**Input to the current agent (what the agent saw before acting):**
{agent_input}

**Output from the current agent (what the agent decided to do):**
{agent_output}

**Environment feedback for the action that was taken:**
Result: {tool_observation}

**Ground truth evaluation results (computed metrics):**
{ground_truth_answer}

## CRITICAL: OUTCOME-BASED ROOT CAUSE ANALYSIS

**If ground_truth_answer shows "ERROR: No predictions found" or similar failure:**
This means `submission.csv` was NOT created. This is a PIPELINE FAILURE.
You MUST perform root cause analysis using the information provided above:

1. **Check "FILES SAVED BY PREVIOUS AGENTS" above**:
   - Did Data Engineer save X_test.pkl? (Look for it in the files list)
   - Did Modeler save model.pkl? (Look for it in the files list)
   - If these files are missing, the UPSTREAM AGENT is at fault!

2. **Check "tool_observation" for errors**:
   - FileNotFoundError for `X_test.pkl` → Data Engineer's fault (didn't save test data)
   - FileNotFoundError for `model.pkl` → Modeler's fault (didn't save model)
   - KeyError, TypeError, AttributeError → Likely Analyst's own code bug
   - No errors but no output → Analyst didn't write code to save submission.csv

3. **Assign blame to the responsible agent**:
   - **Data Engineer's fault** if: `X_test.pkl` is NOT in "FILES SAVED BY PREVIOUS AGENTS"
   - **Modeler's fault** if: `model.pkl` is NOT in "FILES SAVED BY PREVIOUS AGENTS"
   - **Analyst's fault** if: Both files were available but Analyst's code is buggy

4. **Score the CURRENT agent based on their responsibility**:
   - If this agent caused the downstream failure (didn't save required files) → score 0-2
   - If this agent did their job but downstream failed → score based on their actual work quality
   - If this agent failed due to UPSTREAM missing files → score 3-5 (partial credit for trying)

## CRITICAL: File Dependency Chain

The agents MUST follow this dependency chain:
```
Data Engineer saves: X_train.pkl, y_train.pkl, X_test.pkl, scaler.pkl
                              ↓
Modeler loads: X_train.pkl, y_train.pkl → saves: model.pkl
                              ↓
Analyst loads: X_test.pkl, model.pkl → saves: submission.csv
```

**KEY INSIGHT**: If Data Engineer does NOT save `X_test.pkl`, the Analyst CANNOT create `submission.csv`.
This is Data Engineer's fault, not Analyst's fault.

## Expected Agent Outputs

Each agent MUST produce executable Python code (in ```python``` code blocks) that creates specific artifacts:

**Data Engineer** must save to filesystem:
- `X_train.pkl` - preprocessed training features (REQUIRED)
- `y_train.pkl` - training labels (REQUIRED)
- `X_test.pkl` - preprocessed TEST features (CRITICAL - Analyst needs this!)
- Fitted transformers (e.g., `scaler.pkl`, `encoder.pkl`)
- Print a summary of ALL saved files

**Modeler** must save to filesystem:
- Trained model file: `model.pkl` (REQUIRED)
- Print model performance metrics from cross-validation

**Analyst** must save to filesystem:
- Submission file: `submission.csv` (REQUIRED - FINAL DELIVERABLE)
- Format: id column + prediction column(s) as specified in task
- Print confirmation that submission.csv was created with row count

**IMPORTANT**: If an agent outputs text descriptions, explanations, or just filenames WITHOUT executable Python code that actually creates the files, this is a CRITICAL FAILURE (score 0-2).

## Evaluation Guidelines

Evaluate the agent's PROCESS quality based on:
- Did the agent output executable Python code in ```python``` blocks?
- Did the code actually EXECUTE SUCCESSFULLY (check tool_observation for errors)?
- Did the code save ALL required artifacts to the filesystem?
- Did the agent check which files are available before trying to load them?
- For Data Engineer: Did they save X_test.pkl? This is critical!
- For Modeler: Did they save model.pkl? Is algorithm choice reasonable?
- For Analyst: Did they create submission.csv? Did they handle potential missing files?

## Scoring Guidelines (Base Process Scores)

**IMPORTANT: Score 10 is EXCEPTIONAL - reserved for going above and beyond expectations.**
Doing exactly what is required correctly = max score 8-9, NOT 10.
Score 10 requires: innovative solutions, handling edge cases proactively, excellent error recovery, etc.

**Score 10**: EXCEPTIONAL - Agent exceeded expectations (innovative approach, proactive error handling, elegant solution)
**Score 8-9**: Agent's code executed successfully, all required files were saved, methodology is sound
**Score 6-7**: Agent's code executed, most files saved, minor issues or suboptimal methodology
**Score 4-5**: Agent tried but code had errors, or missing important outputs
**Score 2-3**: Agent's code crashed due to upstream failures OR fundamentally flawed approach
**Score 0-1**: Agent produced no useful output or completely wrong code

**For Data Engineer and Modeler**: Use these scores as-is (no ground truth metrics available).
**For Analyst**: You MUST apply the outcome-based caps below. These caps are MANDATORY.

## Using Ground Truth Metrics (ALL AGENTS) - CRITICAL FOR SCORING

**IMPORTANT: The final outcome affects ALL agents in the pipeline, not just the one at fault.**
Even if an agent's process was correct, if the overall pipeline produces a poor result,
ALL agents share some responsibility for the collective failure.

If ground truth metrics are provided, you MUST apply these HARD CAPS to the Analyst's score:

**Classification Tasks - MANDATORY Score Caps:**
| Metric Range | Quality | HARD CAP |
|--------------|---------|----------|
| ROC-AUC ≥ 0.85 or Accuracy ≥ 85% | Excellent | Max 9 (10 only if exceptional) |
| ROC-AUC 0.75-0.85 or Accuracy 75-85% | Good | Max 8 |
| ROC-AUC 0.65-0.75 or Accuracy 65-75% | Mediocre | Max 6 |
| ROC-AUC 0.55-0.65 or Accuracy 55-65% | Poor | Max 4 |
| ROC-AUC < 0.55 or Accuracy < 55% | Very Poor (near random) | Max 3 |

**For upstream agents (Data Engineer, Modeler) when outcome is known to be poor:**
- If the Analyst reports poor metrics due to upstream issues, penalize the responsible upstream agent
- Modeler that produces a near-random model (ROC-AUC ~0.5) = Max score 5, even if they saved model.pkl
- Data Engineer whose preprocessing led to poor features = Max score 6

**Regression Tasks - Interpreting RMSE/MAE:**
The ground truth output includes "RMSE as % of range" - USE THIS DIRECTLY:
- RMSE <10% of range = Excellent (max 9)
- RMSE 10-25% of range = Good (max 8)
- RMSE 25-50% of range = Mediocre (max 6)
- RMSE >50% of range = Poor (max 4)

Also check "RMSE as % of IQR" (interquartile range) which is more robust to outliers:
- If RMSE % of IQR is much higher than % of range, the target has outliers
- Use % of IQR for more accurate assessment in such cases

**Task Difficulty Considerations:**
Some tasks are inherently harder. Apply your ML knowledge:
- Imbalanced classification: F1 is more important than accuracy
- Time series forecasting: Higher RMSE may be acceptable
- Noisy real-world data: 70% accuracy might be good
- Clean synthetic data: 90% accuracy should be achievable

**CRITICAL: Outcome-Based Accountability (Default Caps)**
When outcome is poor, apply the HARD CAP by default UNLESS you are EXTREMELY CONFIDENT
that the current agent is NOT at fault. The burden of proof is high:

**Apply the cap (default)** when:
- It's unclear whose fault the poor outcome is
- Multiple agents could have contributed to the failure
- The root cause analysis is ambiguous

**Exception - Allow higher score (up to 8, never 10)** ONLY when ALL of these are true:
- You have CLEAR EVIDENCE of upstream failure (e.g., Modeler saved unfitted model, Data Engineer missing X_test.pkl)
- The current agent had NO reasonable way to fix the upstream issue
- The current agent's own process was genuinely correct given their inputs
- Example: Analyst got 54% ROC-AUC, but model.pkl was clearly unfitted (NotFittedError in logs) → Can score 6-7

**When in doubt, apply the cap.** It's better to be conservative.

**Example Score Adjustments:**
- Perfect process + 85% accuracy = Score 9
- Perfect process + 78% accuracy = Score 8 (good outcome)
- Perfect process + 65% accuracy = Score 6 (mediocre outcome caps score)
- Perfect process + 54% accuracy, unclear fault = Score 3 (hard cap)
- Perfect process + 54% accuracy, CLEAR upstream fault = Score 6-7 (exception)
- Buggy process + 75% accuracy = Score 6 (process issues reduce score)

## Output Format

First, provide a brief analysis (3-5 sentences) that MUST include:
1. **Files check**: List the files that were available to this agent (from "FILES AVAILABLE TO THIS AGENT")
2. **Execution result**: Did the agent's code execute successfully? (check tool_observation for errors)
3. **Output verification**: What files did this agent save? (if any mentioned in tool_observation)
4. **Blame assignment** (if failure): If submission.csv was not created, explicitly state which agent is responsible based on missing files

Example analysis for failed Analyst:
"Files available: train.csv, test.csv, X_train.pkl, y_train.pkl (NOTE: X_test.pkl is MISSING).
The Analyst's code crashed with FileNotFoundError for 'X_test.pkl'.
This is DATA ENGINEER's fault - they did not save X_test.pkl which the Analyst needs.
The Analyst cannot be fully blamed since the required input file was not provided."

Then provide your score:
PROCESS_SCORE: [0 to 10]
"""
