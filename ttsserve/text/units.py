"""Measurement units after a number: spoken forms in Chinese and English (singular, plural).

UNITS_SPACED may be separated from the number by one space ("5 km"); UNITS_ATTACHED are short or
ambiguous symbols that count as units only when glued to the number ("100m", "5s", "3h"): "I have
5 m..." is more likely a word than metres.
"""

from __future__ import annotations

_UNITS: dict[str, tuple[str, str, str]] = {
    # symbol: (Chinese, English singular, English plural)
    "km": ("公里", "kilometer", "kilometers"),
    "cm": ("厘米", "centimeter", "centimeters"),
    "mm": ("毫米", "millimeter", "millimeters"),
    "km²": ("平方公里", "square kilometer", "square kilometers"),
    "m²": ("平方米", "square meter", "square meters"),
    "㎡": ("平方米", "square meter", "square meters"),
    "km/h": ("公里每小时", "kilometer per hour", "kilometers per hour"),
    "kph": ("公里每小时", "kilometer per hour", "kilometers per hour"),
    "m/s": ("米每秒", "meter per second", "meters per second"),
    "mph": ("英里每小时", "mile per hour", "miles per hour"),
    "kg": ("公斤", "kilogram", "kilograms"),
    "mg": ("毫克", "milligram", "milligrams"),
    "lb": ("磅", "pound", "pounds"),
    "lbs": ("磅", "pound", "pounds"),
    "°C": ("摄氏度", "degree Celsius", "degrees Celsius"),
    "℃": ("摄氏度", "degree Celsius", "degrees Celsius"),
    "°F": ("华氏度", "degree Fahrenheit", "degrees Fahrenheit"),
    "℉": ("华氏度", "degree Fahrenheit", "degrees Fahrenheit"),
    "KB": ("KB", "kilobyte", "kilobytes"),
    "MB": ("MB", "megabyte", "megabytes"),
    "GB": ("GB", "gigabyte", "gigabytes"),
    "TB": ("TB", "terabyte", "terabytes"),
    "Mbps": ("兆比特每秒", "megabit per second", "megabits per second"),
    "ms": ("毫秒", "millisecond", "milliseconds"),
    "sec": ("秒", "second", "seconds"),
    "min": ("分钟", "minute", "minutes"),
    "hr": ("小时", "hour", "hours"),
    "hrs": ("小时", "hour", "hours"),
    "ml": ("毫升", "milliliter", "milliliters"),
    "mL": ("毫升", "milliliter", "milliliters"),
    "kW": ("千瓦", "kilowatt", "kilowatts"),
    "kWh": ("千瓦时", "kilowatt hour", "kilowatt hours"),
    "Hz": ("赫兹", "hertz", "hertz"),
    "kHz": ("千赫兹", "kilohertz", "kilohertz"),
    "MHz": ("兆赫兹", "megahertz", "megahertz"),
    "GHz": ("吉赫兹", "gigahertz", "gigahertz"),
    "mAh": ("毫安时", "milliamp hour", "milliamp hours"),
    # Only when glued to the number:
    "m": ("米", "meter", "meters"),
    "g": ("克", "gram", "grams"),
    "s": ("秒", "second", "seconds"),
    "h": ("小时", "hour", "hours"),
    "L": ("升", "liter", "liters"),
    "W": ("瓦", "watt", "watts"),
    "V": ("伏", "volt", "volts"),
    "°": ("度", "degree", "degrees"),
}

UNITS_ATTACHED: frozenset[str] = frozenset({"m", "g", "s", "h", "L", "W", "V"})
UNITS_SPACED: frozenset[str] = frozenset(_UNITS) - UNITS_ATTACHED


def unit_words(symbol: str) -> tuple[str, str, str]:
    """(Chinese, English singular, English plural) of a unit symbol."""
    return _UNITS[symbol]
